"""The MMLU gate: accuracy, 95% Wilson interval, bound and baseline checks - pure Python.

* ``lower_bound``: pass iff accuracy >= bound (not the reference's strict ``>``).
* ``max_drop``: pass iff baseline_accuracy - accuracy <= max_drop; the baseline is a recorded
  number (``baseline=recorded`` + ``baseline_accuracy``), or per-question results of the
  unquantized weights on the same questions: evaluated in the same stage (``baseline=evaluate``,
  reused from launcher/mmlu/baseline_cache.py when its key matches) or taken from that cache
  (``baseline=cached``).  With per-question results the drop is paired
  (launcher/mmlu/paired.py: McNemar exact 95% interval, agreement, mean KL over A-D).
* A warning ("raise fraction") when an interval strictly contains a threshold: the decision
  could flip with another sample of the same size.  For ``lower_bound`` (and ``max_drop``
  against a recorded number) the Wilson interval of the accuracy; for ``max_drop`` against
  per-question results the paired interval of the drop.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Optional, Sequence

from launcher.contract import BaselineMode, values
from launcher.mmlu.paired import PairedComparison

Z95 = 1.959963984540054
BASELINE_MODES = values(BaselineMode)
PER_QUESTION_BASELINES = ("evaluate", "cached")


def wilson_interval(correct: int, n: int, z: float = Z95) -> tuple[float, float]:
    if n <= 0:
        return (0.0, 1.0)
    if not 0 <= correct <= n:
        raise ValueError(f"correct={correct} must be in [0, n={n}]")
    p = correct / n
    z2 = z * z
    denom = 1 + z2 / n
    center = (p + z2 / (2 * n)) / denom
    half = z / denom * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    return (max(0.0, center - half), min(1.0, center + half))


def check_gate_config(lower_bound: Optional[float], max_drop: Optional[float], baseline: str,
                      baseline_accuracy: Optional[float]) -> None:
    """ValueError naming the key, for config validation (no torch)."""
    if baseline not in BASELINE_MODES:
        raise ValueError(f"stages.mmlu.baseline={baseline!r}: valid values are {list(BASELINE_MODES)}")
    for key, v in (("lower_bound", lower_bound), ("baseline_accuracy", baseline_accuracy)):
        if v is not None and not 0 <= v <= 1:
            raise ValueError(f"stages.mmlu.{key}={v!r}: must be null or in [0, 1]")
    if max_drop is not None and not 0 <= max_drop <= 1:
        raise ValueError(f"stages.mmlu.max_drop={max_drop!r}: must be null or in [0, 1]")
    if baseline == "recorded" and baseline_accuracy is None:
        raise ValueError("stages.mmlu.baseline_accuracy=None: required with baseline=recorded "
                         "(a number in [0, 1])")
    if baseline != "recorded" and baseline_accuracy is not None:
        raise ValueError(f"stages.mmlu.baseline_accuracy={baseline_accuracy!r}: only used with "
                         f"stages.mmlu.baseline=recorded (got baseline={baseline!r})")
    if max_drop is not None and baseline == "none":
        raise ValueError(f"stages.mmlu.max_drop={max_drop!r}: needs a baseline: set stages.mmlu.baseline to "
                         f"recorded, evaluate or cached")


@dataclass
class GateDecision:
    passed: bool
    accuracy: float
    n: int
    correct: int
    interval: tuple[float, float]
    lower_bound: Optional[float] = None
    max_drop: Optional[float] = None
    baseline_accuracy: Optional[float] = None
    drop: Optional[float] = None
    agreement: Optional[float] = None
    paired: Optional[PairedComparison] = None
    failures: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def decide(correct: int, n: int, lower_bound: Optional[float] = None,
           max_drop: Optional[float] = None, baseline_accuracy: Optional[float] = None,
           agreement: Optional[float] = None, paired: Optional[PairedComparison] = None) -> GateDecision:
    """The gate's verdict.  ``paired`` (per-question baseline on the same questions) sets the
    agreement and judges max_drop on the paired drop and its interval."""
    if n <= 0:
        return GateDecision(False, 0.0, 0, 0, (0.0, 1.0), lower_bound, max_drop,
                            baseline_accuracy, failures=["no questions were evaluated"])
    acc = correct / n
    lo, hi = wilson_interval(correct, n)
    if paired is not None:
        if (paired.n, paired.correct) != (n, correct):
            raise ValueError(f"paired comparison is of {paired.correct}/{paired.n}, not {correct}/{n}")
        baseline_accuracy, agreement = paired.baseline_correct / n, paired.agreement
    d = GateDecision(True, acc, n, correct, (lo, hi), lower_bound, max_drop, baseline_accuracy,
                     agreement=agreement, paired=paired)
    if paired is not None:
        d.drop = paired.drop
    if lower_bound is not None:
        if acc < lower_bound:
            d.failures.append(f"accuracy {acc:.4f} ({correct}/{n}) < lower_bound {lower_bound}")
        if lo < lower_bound < hi:
            d.warnings.append(f"95% interval [{lo:.4f}, {hi:.4f}] straddles lower_bound "
                              f"{lower_bound}: raise fraction (n={n}) for a stable decision")
    if max_drop is not None:
        if baseline_accuracy is None:
            raise ValueError("max_drop needs baseline_accuracy")
        d.drop = paired.drop if paired is not None else baseline_accuracy - acc
        if d.drop > max_drop + 1e-12:
            d.failures.append(f"accuracy {acc:.4f} dropped {d.drop:.4f} from baseline "
                              f"{baseline_accuracy:.4f} > max_drop {max_drop}")
        threshold = baseline_accuracy - max_drop
        if paired is not None:
            plo, phi = paired.interval
            if plo < max_drop < phi:
                d.warnings.append(f"paired 95% interval of the drop [{plo:.4f}, {phi:.4f}] ({paired.method}; "
                                  f"{paired.n10} questions lost, {paired.n01} gained) straddles max_drop "
                                  f"{max_drop}: raise fraction (n={n}) for a stable decision")
        elif lo < threshold < hi:
            d.warnings.append(f"95% interval [{lo:.4f}, {hi:.4f}] straddles baseline - max_drop "
                              f"= {threshold:.4f}: raise fraction (n={n}) for a stable decision")
    d.passed = not d.failures
    return d


def per_subject(subjects: Sequence[str], correct: Sequence[bool]) -> "OrderedDict[str, dict]":
    """{subject: {n, correct, accuracy}} in first-seen order."""
    out: OrderedDict[str, dict] = OrderedDict()
    for s, c in zip(subjects, correct):
        e = out.setdefault(s, {"n": 0, "correct": 0})
        e["n"] += 1
        e["correct"] += int(bool(c))
    for e in out.values():
        e["accuracy"] = e["correct"] / e["n"]
    return out


def agreement(a: Sequence[int], b: Sequence[int]) -> float:
    if len(a) != len(b):
        raise ValueError(f"prediction lists differ in length: {len(a)} vs {len(b)}")
    return sum(x == y for x, y in zip(a, b)) / len(a) if a else 1.0


def format_table(subjects: "OrderedDict[str, dict]") -> str:
    width = max([len("subject")] + [len(s) for s in subjects])
    lines = [f"{'subject':<{width}}  {'n':>5}  {'correct':>7}  {'acc':>6}"]
    for s, e in subjects.items():
        lines.append(f"{s:<{width}}  {e['n']:>5}  {e['correct']:>7}  {e['accuracy']:>6.3f}")
    return "\n".join(lines)
