"""Gate statistics and decisions (pure)."""
import pytest

from launcher.mmlu.gate import agreement, check_gate_config, decide, per_subject, wilson_interval


def test_wilson_known_values():
    lo, hi = wilson_interval(5, 10)
    assert (round(lo, 4), round(hi, 4)) == (0.2366, 0.7634)
    lo, hi = wilson_interval(0, 10)
    assert lo == 0.0 and round(hi, 4) == 0.2775
    lo, hi = wilson_interval(10, 10)
    assert round(lo, 4) == 0.7225 and round(hi, 12) == 1.0
    lo, hi = wilson_interval(81, 263)
    assert (round(lo, 4), round(hi, 4)) == (0.2553, 0.3662)


def test_lower_bound_inclusive():
    d = decide(60, 100, lower_bound=0.60)
    assert d.passed and d.failures == []
    d = decide(59, 100, lower_bound=0.60)
    assert not d.passed
    assert d.failures == ["accuracy 0.5900 (59/100) < lower_bound 0.6"]


def test_straddle_warning():
    d = decide(110, 168, lower_bound=0.60)
    assert d.passed
    assert len(d.warnings) == 1 and "raise fraction" in d.warnings[0]
    assert decide(160, 168, lower_bound=0.60).warnings == []


def test_max_drop_against_baseline():
    d = decide(70, 100, max_drop=0.05, baseline_accuracy=0.74, agreement=0.9)
    assert d.passed and d.drop == pytest.approx(0.04) and d.agreement == 0.9
    d = decide(70, 100, max_drop=0.05, baseline_accuracy=0.75)
    assert d.passed                                      # drop == max_drop passes
    d = decide(69, 100, max_drop=0.05, baseline_accuracy=0.75)
    assert not d.passed
    assert d.failures == ["accuracy 0.6900 dropped 0.0600 from baseline 0.7500 > max_drop 0.05"]
    d = decide(50, 100, lower_bound=0.6, max_drop=0.05, baseline_accuracy=0.75)
    assert len(d.failures) == 2


def test_no_questions_fails():
    assert decide(0, 0, lower_bound=0.1).failures == ["no questions were evaluated"]


def test_config_checks():
    check_gate_config(0.5, None, "none", None)
    check_gate_config(None, 0.02, "evaluate", None)
    with pytest.raises(ValueError, match=r"stages.mmlu.baseline_accuracy=None: required with baseline=recorded"):
        check_gate_config(None, 0.02, "recorded", None)
    with pytest.raises(ValueError, match=r"stages.mmlu.max_drop=0.02: needs a baseline"):
        check_gate_config(None, 0.02, "none", None)
    with pytest.raises(ValueError, match=r"stages.mmlu.baseline='x': valid values are \['none', 'recorded', 'evaluate', 'cached'\]"):
        check_gate_config(None, None, "x", None)
    with pytest.raises(ValueError, match=r"stages.mmlu.lower_bound=1.5: must be null or in \[0, 1\]"):
        check_gate_config(1.5, None, "none", None)


def test_per_subject_and_agreement():
    ps = per_subject(["a", "b", "a"], [True, False, False])
    assert ps == {"a": {"n": 2, "correct": 1, "accuracy": 0.5}, "b": {"n": 1, "correct": 0, "accuracy": 0.0}}
    assert agreement([0, 1, 2, 3], [0, 1, 3, 3]) == 0.75
