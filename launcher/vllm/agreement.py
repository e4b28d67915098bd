"""Does the served export answer the gate's questions as the gate's model did?  Pure Python.

Per question the gate recorded (mmlu/results.json) the raw logits of the four choice tokens
" A".." D" at the prompt's last token; vLLM gives log-probabilities of the same four tokens at
the same position, normalised over the whole vocabulary.  The two differ by a per-question
constant (the log-partition), so neither is compared raw.  **Choice score** here is the
log-softmax over the four choices, computed the same way on both sides: shift-invariant, so
``log_softmax4(gate logits)`` and ``log_softmax4(vLLM logprobs)`` are equal when the two models
agree, and the argmax (the prediction) is the same as the argmax of either raw form.

Per question:
  * ``gate_prediction`` (results.json's) and ``vllm_prediction`` (argmax; first index on ties);
  * ``gate_margin``: the gate's top-1 minus top-2 logit (equal in log-softmax units);
  * ``score_diff``: max over the four choices of |gate score - vLLM score|;
  * ``tie``: gate_margin < tie_margin - such a question can flip on rounding alone (bf16 in the
    gate vs bf16 in vLLM, other kernels, another batch shape), so it is reported but not counted.

``agreement`` = identical predictions / counted (non-tie) questions; ``accuracy`` = vLLM's correct
predictions over all scored questions (ties included: accuracy does not depend on them).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from statistics import median
from typing import Sequence

LETTERS = ("A", "B", "C", "D")


def log_softmax(values: Sequence[float]) -> list[float]:
    m = max(values)
    lse = m + math.log(sum(math.exp(v - m) for v in values))
    return [v - lse for v in values]


def argmax(values: Sequence[float]) -> int:
    """Index of the largest value; the first one on ties (as torch.argmax on the gate side)."""
    best = 0
    for i, v in enumerate(values):
        if v > values[best]:
            best = i
    return best


def top2_margin(values: Sequence[float]) -> float:
    a, b = sorted(values, reverse=True)[:2]
    return a - b


@dataclass(frozen=True)
class GateAnswer:
    """One question as the gate recorded it (an entry of mmlu/results.json's ``questions``)."""
    id: str
    answer: int                 # 0..3
    prediction: int             # 0..3
    logits: tuple[float, ...]   # the four choice logits


@dataclass(frozen=True)
class ChoiceRow:
    id: str
    answer: str
    gate_prediction: str
    vllm_prediction: str
    agree: bool
    correct: bool               # vLLM's prediction is the answer
    tie: bool
    gate_margin: float
    score_diff: float
    gate_scores: list[float]    # log-softmax over the four choices
    vllm_scores: list[float]
    vllm_logprobs: list[float]  # as vLLM returned them (log-softmax over the vocabulary)


def compare(gate: Sequence[GateAnswer], vllm_logprobs: Sequence[Sequence[float]],
            tie_margin: float) -> list[ChoiceRow]:
    if len(gate) != len(vllm_logprobs):
        raise ValueError(f"{len(gate)} gate answers but {len(vllm_logprobs)} vLLM score rows")
    rows = []
    for g, lp in zip(gate, vllm_logprobs):
        if len(lp) != 4 or len(g.logits) != 4:
            raise ValueError(f"{g.id}: expected 4 choice scores, got gate {len(g.logits)}, vLLM {len(lp)}")
        gs, vs = log_softmax(g.logits), log_softmax(lp)
        pred = argmax(lp)
        margin = top2_margin(g.logits)
        rows.append(ChoiceRow(
            id=g.id, answer=LETTERS[g.answer], gate_prediction=LETTERS[g.prediction],
            vllm_prediction=LETTERS[pred], agree=pred == g.prediction, correct=pred == g.answer,
            tie=margin < tie_margin, gate_margin=round(margin, 6),
            score_diff=round(max(abs(a - b) for a, b in zip(gs, vs)), 6),
            gate_scores=[round(x, 6) for x in gs], vllm_scores=[round(x, 6) for x in vs],
            vllm_logprobs=[round(float(x), 6) for x in lp]))
    return rows


def summarize(rows: Sequence[ChoiceRow], gate: Sequence[GateAnswer]) -> dict:
    """Totals over ``rows`` (no verdict): agreement over non-ties, accuracies, score differences."""
    counted = [r for r in rows if not r.tie]
    agree = sum(r.agree for r in counted)
    n = len(rows)
    diffs = [r.score_diff for r in rows]
    return {
        "n": n, "n_counted": len(counted), "n_ties": n - len(counted),
        "agreement": (agree / len(counted)) if counted else None, "n_agree": agree,
        "agreement_all": (sum(r.agree for r in rows) / n) if n else None,
        "accuracy": (sum(r.correct for r in rows) / n) if n else None,
        "n_correct": sum(r.correct for r in rows),
        "gate_accuracy": (sum(g.prediction == g.answer for g in gate) / n) if n else None,
        "disagreements": [r.id for r in counted if not r.agree],
        "tie_disagreements": [r.id for r in rows if r.tie and not r.agree],
        "max_score_diff": max(diffs) if diffs else None,
        "median_score_diff": median(diffs) if diffs else None,
        "questions": [asdict(r) for r in rows],
    }


def verdict(summary: dict, min_agreement: float, min_accuracy: float, tie_margin: float) -> list[str]:
    """Why the choice check fails ([] = pass)."""
    problems = []
    n, counted, agreement = summary["n"], summary["n_counted"], summary["agreement"]
    if n == 0:
        return ["no gate question was scored"]
    acc, gacc = summary["accuracy"], summary["gate_accuracy"]
    same = (f"served accuracy {acc:.3f} vs the gate's {gacc:.3f} on the same {n} questions "
            f"(a drop of {gacc - acc:.3f})")
    if agreement is None:
        problems.append(f"every one of the {n} questions is a tie (gate top-2 margin < tie_margin "
                        f"{tie_margin:g}): agreement cannot be judged; lower "
                        f"stages.vllm_smoke.tie_margin or score more questions")
    elif agreement < min_agreement:
        bad = summary["disagreements"]
        problems.append(
            f"agreement with the gate {agreement:.3f} ({summary['n_agree']}/{counted} questions with "
            f"gate margin >= {tie_margin:g}) < min_agreement {min_agreement:g}: vLLM predicts "
            f"differently on {len(bad)} ({', '.join(bad[:5])}{', ...' if len(bad) > 5 else ''}); "
            f"{same}; median choice-score difference {summary['median_score_diff']:.3f}")
    if acc < min_accuracy:
        problems.append(f"served accuracy {acc:.3f} ({summary['n_correct']}/{n}) < min_accuracy "
                        f"{min_accuracy:g} (the gate's on the same questions: {gacc:.3f})")
    return problems


def default_min_agreement(quantized: bool) -> float:
    """0.99 for an unquantized export (recipe=none); 0.95 for a quantized one served at its own
    precision (vLLM's real low-precision kernels vs the gate's fake-quantized model)."""
    return 0.95 if quantized else 0.99


def gate_answer(entry: dict, qid: str) -> GateAnswer:
    """A results.json question entry -> GateAnswer (ValueError naming what is missing)."""
    try:
        return GateAnswer(id=qid, answer=LETTERS.index(entry["answer"]),
                          prediction=LETTERS.index(entry["prediction"]),
                          logits=tuple(float(x) for x in entry["logits"]))
    except (KeyError, ValueError, TypeError) as e:
        raise ValueError(f"mmlu/results.json question {qid}: expected answer, prediction (A-D) and "
                         f"4 logits ({type(e).__name__}: {e})") from e


def pick(n_total: int, n: int) -> list[int]:
    """``n`` indices spread evenly over ``range(n_total)``, in order; all of them when n is 0
    or >= n_total."""
    if n <= 0 or n >= n_total:
        return list(range(n_total))
    return [(i * n_total) // n for i in range(n)]

