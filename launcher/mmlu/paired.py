"""Paired comparison of a quantized model with its baseline on the same MMLU questions (pure Python).

Both models answer the same n questions, so their accuracies are paired: what differs is only
the discordant questions, n10 (baseline right, quantized wrong) and n01 (the reverse).  The
accuracy drop is (n10 - n01) / n.

Interval (``DROP_METHOD = "mcnemar_exact"``): McNemar's exact test conditions on the m = n10 + n01
discordant questions, where n10 ~ Binomial(m, p).  The Clopper-Pearson 95% interval [p_lo, p_hi]
for p gives the drop's interval ((2 p_lo - 1) m / n, (2 p_hi - 1) m / n), and the exact two-sided
p-value for "no difference" is min(1, 2 P[Binomial(m, 1/2) <= min(n10, n01)]).  It is exact and
deterministic (no resampling), and much narrower than two independent Wilson intervals: questions
both models get right or both get wrong carry no noise about the drop.  Being conditional on m,
it is the single point 0 when the predictions never disagree (m = 0).

KL: per question, the softmax over the four choice logits of each model; ``mean_kl`` is the mean
of KL(baseline || quantized) in nats, a finer signal than accuracy on small subsets (it moves
before any prediction flips).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Sequence

DROP_METHOD = "mcnemar_exact"
DROP_METHOD_DESCRIPTION = ("McNemar exact: Clopper-Pearson interval on the discordant questions "
                           "(baseline-only correct of all discordant), scaled by discordant/n")
LEVEL = 0.95


def _log_binom_pmf(k: int, m: int, p: float) -> float:
    if p <= 0.0:
        return 0.0 if k == 0 else -math.inf
    if p >= 1.0:
        return 0.0 if k == m else -math.inf
    return (math.lgamma(m + 1) - math.lgamma(k + 1) - math.lgamma(m - k + 1)
            + k * math.log(p) + (m - k) * math.log1p(-p))


def binom_cdf(x: int, m: int, p: float) -> float:
    """P[Binomial(m, p) <= x]."""
    if x < 0:
        return 0.0
    if x >= m:
        return 1.0
    logs = [_log_binom_pmf(k, m, p) for k in range(x + 1)]
    top = max(logs)
    if top == -math.inf:
        return 0.0
    return min(1.0, math.exp(top) * sum(math.exp(v - top) for v in logs))


def _bisect(f, target: float, increasing: bool) -> float:
    lo, hi = 0.0, 1.0
    for _ in range(200):
        mid = (lo + hi) / 2
        if (f(mid) < target) == increasing:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-15:
            break
    return (lo + hi) / 2


def clopper_pearson(x: int, m: int, level: float = LEVEL) -> tuple[float, float]:
    """Exact two-sided interval for a binomial proportion (x successes in m trials)."""
    if m <= 0:
        return (0.0, 1.0)
    if not 0 <= x <= m:
        raise ValueError(f"x={x} must be in [0, m={m}]")
    alpha = 1.0 - level
    # lower: P[X >= x | p] = alpha/2 (increasing in p); upper: P[X <= x | p] = alpha/2 (decreasing)
    lo = 0.0 if x == 0 else _bisect(lambda p: 1.0 - binom_cdf(x - 1, m, p), alpha / 2, increasing=True)
    hi = 1.0 if x == m else _bisect(lambda p: binom_cdf(x, m, p), alpha / 2, increasing=False)
    return (lo, hi)


def mcnemar_exact_p(n10: int, n01: int) -> float:
    m = n10 + n01
    if m == 0:
        return 1.0
    return min(1.0, 2.0 * binom_cdf(min(n10, n01), m, 0.5))


def _softmax(xs: Sequence[float]) -> list[float]:
    top = max(xs)
    e = [math.exp(x - top) for x in xs]
    s = sum(e)
    return [v / s for v in e]


def kl_divergence(base_logits: Sequence[float], quant_logits: Sequence[float]) -> float:
    """KL(softmax(base) || softmax(quant)) in nats."""
    p, q = _softmax(base_logits), _softmax(quant_logits)
    return sum(pi * (math.log(pi) - math.log(qi)) for pi, qi in zip(p, q) if pi > 0)


@dataclass
class PairedComparison:
    n: int
    baseline_correct: int
    correct: int
    n10: int                 # baseline right, quantized wrong
    n01: int                 # baseline wrong, quantized right
    drop: float              # baseline accuracy - accuracy = (n10 - n01) / n
    interval: tuple[float, float]
    p_value: float           # McNemar exact, two-sided
    agreement: float         # same predicted letter
    mean_kl: float
    max_kl: float
    method: str = DROP_METHOD
    level: float = LEVEL

    def to_dict(self) -> dict:
        d = asdict(self)
        d["interval"] = list(self.interval)
        d["method_description"] = DROP_METHOD_DESCRIPTION
        return d


def compare(answers: Sequence[int], predictions: Sequence[int], baseline_predictions: Sequence[int],
            logits: Sequence[Sequence[float]], baseline_logits: Sequence[Sequence[float]],
            level: float = LEVEL) -> PairedComparison:
    """Paired statistics of the quantized predictions against the baseline's on the same questions."""
    n = len(answers)
    if not (len(predictions) == len(baseline_predictions) == len(logits) == len(baseline_logits) == n):
        raise ValueError(f"paired inputs differ in length: answers {n}, predictions {len(predictions)}, "
                         f"baseline {len(baseline_predictions)}, logits {len(logits)}/{len(baseline_logits)}")
    if n == 0:
        raise ValueError("no questions to compare")
    q_ok = [p == a for p, a in zip(predictions, answers)]
    b_ok = [p == a for p, a in zip(baseline_predictions, answers)]
    n10 = sum(b and not q for b, q in zip(b_ok, q_ok))
    n01 = sum(q and not b for b, q in zip(b_ok, q_ok))
    m = n10 + n01
    if m:
        p_lo, p_hi = clopper_pearson(n10, m, level)
        interval = ((2 * p_lo - 1) * m / n, (2 * p_hi - 1) * m / n)
    else:
        interval = (0.0, 0.0)
    kls = [kl_divergence(b, q) for b, q in zip(baseline_logits, logits)]
    return PairedComparison(
        n=n, baseline_correct=sum(b_ok), correct=sum(q_ok), n10=n10, n01=n01,
        drop=sum(b_ok) / n - sum(q_ok) / n,   # = (n10 - n01) / n, spelled as baseline accuracy - accuracy
        interval=interval, p_value=mcnemar_exact_p(n10, n01),
        agreement=sum(p == b for p, b in zip(predictions, baseline_predictions)) / n,
        mean_kl=sum(kls) / n, max_kl=max(kls), level=level)
