"""An evaluation's predictions, the gate's decision over them, and mmlu/results.json (pure Python).

* ``Prediction``: one question's predicted choice and its four choice logits (what a rank reads
  off the LM head, ``launcher.mmlu.evaluate``; what the baseline cache stores);
* ``Evaluation``: the predictions of every prepared question, in prompt order;
* ``decide``: the gate's verdict (``launcher.mmlu.gate.decide``) on an evaluation, paired with a
  per-question baseline when ``stages.mmlu.baseline`` is evaluate or cached;
* ``build_results``: the content of ``mmlu/results.json``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, NamedTuple, Optional, Sequence, Union

from launcher.mmlu import gate
from launcher.mmlu.batching import padding_efficiency
from launcher.mmlu.data import LETTERS
from launcher.mmlu.paired import compare


class Prediction(NamedTuple):
    choice: int                 # index into LETTERS
    logits: list[float]         # the four choice logits the choice is the argmax of


@dataclass(frozen=True)
class Evaluation:
    """Every prepared question's prediction, in prompt order."""

    predictions: tuple[Prediction, ...]

    @classmethod
    def of(cls, results: Union["Evaluation", Mapping[int, Sequence[Any]]]) -> "Evaluation":
        """From {prompt index: (choice, logits)} covering 0..n-1 (as gathered, or as cached)."""
        if isinstance(results, Evaluation):
            return results
        if sorted(results) != list(range(len(results))):
            raise ValueError(f"results cover prompts {sorted(results)[:5]}...; expected 0..{len(results) - 1}")
        return cls(tuple(Prediction(int(results[i][0]), list(results[i][1])) for i in range(len(results))))

    def __len__(self) -> int:
        return len(self.predictions)

    @property
    def choices(self) -> list[int]:
        return [p.choice for p in self.predictions]

    @property
    def logits(self) -> list[list[float]]:
        return [p.logits for p in self.predictions]

    def correct(self, answers: Sequence[int]) -> int:
        return sum(c == a for c, a in zip(self.choices, answers))


Results = Union[Evaluation, Mapping[int, Sequence[Any]]]


def decide(prepared, results: Results, scfg, baseline: Optional[Results]) -> gate.GateDecision:
    """The gate's decision on ``results`` (``prepared``: ``launcher.mmlu.prepared.Prepared``)."""
    evaluation = Evaluation.of(results)
    answers = [p.question.answer for p in prepared.prompts]
    correct = evaluation.correct(answers)
    if scfg.baseline in gate.PER_QUESTION_BASELINES and baseline is not None:
        base = Evaluation.of(baseline)
        paired = compare(answers, evaluation.choices, base.choices, evaluation.logits, base.logits)
        return gate.decide(correct, len(answers), scfg.lower_bound, scfg.max_drop, paired=paired)
    base_acc = float(scfg.baseline_accuracy) if scfg.baseline == "recorded" else None
    return gate.decide(correct, len(answers), scfg.lower_bound, scfg.max_drop, base_acc)


def _rounded(logits: Sequence[float]) -> list[float]:
    return [round(float(x), 6) for x in logits]


def build_results(prepared, results: Results, scfg, decision: gate.GateDecision,
                  plan, baseline: Optional[Results] = None, timings: Optional[dict] = None) -> dict:
    """The content of mmlu/results.json."""
    evaluation = Evaluation.of(results)
    base = None if baseline is None else Evaluation.of(baseline)
    qs = [p.question for p in prepared.prompts]
    subjects = gate.per_subject([q.subject for q in qs], [p.choice == q.answer
                                                          for p, q in zip(evaluation.predictions, qs)])
    per_q = []
    for i, (q, p) in enumerate(zip(qs, evaluation.predictions)):
        entry = {"index": q.index, "subject": q.subject, "answer": LETTERS[q.answer],
                 "prediction": LETTERS[p.choice], "correct": p.choice == q.answer, "logits": _rounded(p.logits)}
        if base is not None:
            entry["baseline_prediction"] = LETTERS[base.predictions[i].choice]
            entry["baseline_logits"] = _rounded(base.predictions[i].logits)
        per_q.append(entry)
    return {
        "accuracy": decision.accuracy, "n": decision.n, "correct": decision.correct,
        "interval": list(decision.interval), "interval_level": 0.95, "interval_method": "wilson",
        "lower_bound": decision.lower_bound, "max_drop": decision.max_drop,
        "baseline": {"mode": scfg.baseline, "accuracy": decision.baseline_accuracy,
                     "drop": decision.drop,
                     "paired": decision.paired.to_dict() if decision.paired is not None else None},
        "mean_kl": decision.paired.mean_kl if decision.paired is not None else None,
        "agreement": decision.agreement, "pass": decision.passed,
        "failures": decision.failures, "warnings": decision.warnings,
        "dataset": scfg.dataset, "dev_dataset": scfg.dev_dataset, "fraction": scfg.fraction,
        "few_shots": scfg.few_shots, "add_bos": scfg.add_bos, "truncated_prompts": prepared.truncated,
        "per_subject": subjects, "questions": per_q,
        "shard_mode": plan.mode, "plan": plan.summary(),
        "batches": {"count": len(prepared.batches), "batch_size": scfg.batch_size,
                    "max_batch_tokens": scfg.max_batch_tokens,
                    "resolved": prepared.limits.summary() if prepared.limits else None},
        "padding_efficiency": padding_efficiency(prepared.batches),
        "padding_efficiency_with_plan": padding_efficiency(prepared.batches, plan.shard_padded_tokens()),
        "timings": timings or {},
    }
