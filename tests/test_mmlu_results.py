"""launcher/mmlu/results.py: typed predictions, the gate's decision and mmlu/results.json (pure Python)."""
from types import SimpleNamespace

import pytest

from launcher.mmlu.results import Evaluation, Prediction, build_results, decide


def _prepared(answers):
    prompts = [SimpleNamespace(question=SimpleNamespace(index=10 + i, subject="anatomy" if i % 2 else "virology",
                                                        answer=a), text=f"q{i}") for i, a in enumerate(answers)]
    return SimpleNamespace(prompts=prompts, batches=[], truncated=0, limits=None)


def _scfg(**kw):
    base = dict(baseline="none", lower_bound=None, max_drop=None, baseline_accuracy=None, dataset="d",
                dev_dataset=None, fraction=1.0, few_shots=0, add_bos=False, batch_size=8, max_batch_tokens=64)
    return SimpleNamespace(**{**base, **kw})


PLAN = SimpleNamespace(mode="balanced", summary=lambda: {"steps": 1}, shard_padded_tokens=lambda: None)


def _logits(choice):
    out = [0.0] * 4
    out[choice] = 1.0
    return out


def test_evaluation_from_gathered_results():
    ev = Evaluation.of({1: (2, _logits(2)), 0: Prediction(0, _logits(0))})
    assert ev.predictions == (Prediction(0, _logits(0)), Prediction(2, _logits(2)))
    assert ev.choices == [0, 2] and len(ev) == 2 and ev.correct([0, 1]) == 1
    assert Evaluation.of(ev) is ev
    with pytest.raises(ValueError, match="expected 0..1"):
        Evaluation.of({0: (0, _logits(0)), 2: (1, _logits(1))})


def test_decide_lower_bound_and_recorded_baseline():
    prepared = _prepared([0, 1, 2, 3])
    results = {i: (c, _logits(c)) for i, c in enumerate([0, 1, 2, 0])}
    d = decide(prepared, results, _scfg(lower_bound=0.9), None)
    assert (d.correct, d.n, d.passed, d.agreement) == (3, 4, False, None)
    assert d.failures == ["accuracy 0.7500 (3/4) < lower_bound 0.9"]
    d = decide(prepared, results, _scfg(baseline="recorded", baseline_accuracy=0.8, max_drop=0.1), None)
    assert d.baseline_accuracy == 0.8 and d.passed and d.paired is None


def test_decide_pairs_a_per_question_baseline():
    prepared = _prepared([0, 0, 0, 0])
    results = {i: (c, _logits(c)) for i, c in enumerate([0, 1, 0, 0])}
    baseline = {i: (0, _logits(0)) for i in range(4)}
    d = decide(prepared, results, _scfg(baseline="evaluate", max_drop=0.5), baseline)
    assert d.paired is not None and d.baseline_accuracy == 1.0 and d.agreement == 0.75 and d.drop == 0.25
    assert d.passed


def test_build_results_names_every_question():
    prepared = _prepared([0, 1])
    results = {0: (0, [0.1234567, 0.0, 0.0, 0.0]), 1: (2, _logits(2))}
    baseline = {0: (0, _logits(0)), 1: (1, _logits(1))}
    scfg = _scfg(baseline="evaluate", max_drop=0.5)
    doc = build_results(prepared, results, scfg, decide(prepared, results, scfg, baseline), PLAN, baseline,
                        {"eval_s": 1.0})
    assert doc["questions"] == [
        {"index": 10, "subject": "virology", "answer": "A", "prediction": "A", "correct": True,
         "logits": [0.123457, 0.0, 0.0, 0.0], "baseline_prediction": "A", "baseline_logits": _logits(0)},
        {"index": 11, "subject": "anatomy", "answer": "B", "prediction": "C", "correct": False,
         "logits": _logits(2), "baseline_prediction": "B", "baseline_logits": _logits(1)}]
    assert (doc["accuracy"], doc["n"], doc["correct"], doc["pass"]) == (0.5, 2, 1, True)
    assert doc["baseline"]["mode"] == "evaluate" and doc["baseline"]["accuracy"] == 1.0
    assert doc["per_subject"]["anatomy"]["correct"] == 0 and doc["timings"] == {"eval_s": 1.0}
    assert doc["plan"] == {"steps": 1} and doc["shard_mode"] == "balanced"
