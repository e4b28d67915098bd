"""The smoke's verdict logic without vLLM: choice scores and agreement with the gate
(launcher.vllm.agreement), the gate's questions rebuilt from mmlu/results.json
(launcher.vllm.gate_questions, with the tiny model's real tokenizer), generation checks
(launcher.vllm.generation) and the config checks of stages.vllm_smoke."""
from __future__ import annotations

import json
import math
import os

import pytest

from launcher.vllm import agreement as ag
from launcher.vllm import generation as gen

# --- choice scores ----------------------------------------------------------------------------


def test_log_softmax_is_the_same_for_raw_logits_and_vocab_logprobs():
    logits = [5.84, 3.15, 5.78, 2.0]
    # vLLM's full-vocabulary log-probabilities are the logits minus one log-partition
    vocab_logprobs = [x - 17.25 for x in logits]
    a, b = ag.log_softmax(logits), ag.log_softmax(vocab_logprobs)
    assert max(abs(x - y) for x, y in zip(a, b)) < 1e-12
    assert abs(sum(math.exp(x) for x in a) - 1) < 1e-12
    assert ag.log_softmax([0.0] * 4) == [-math.log(4)] * 4


def test_argmax_and_margin():
    assert ag.argmax([1, 3, 3, 0]) == 1                 # first index on ties, as torch.argmax
    assert ag.top2_margin([1.0, 3.5, 3.0, 0.0]) == 0.5


def _gate(i, answer, logits):
    return ag.GateAnswer(id=f"s/{i}", answer=answer, prediction=ag.argmax(logits), logits=tuple(logits))


def test_compare_rows():
    gate = [_gate(0, 0, [5.0, 3.0, 1.0, 0.0]),          # vLLM agrees (same logits, shifted)
            _gate(1, 1, [1.0, 4.0, 0.0, 0.0]),          # vLLM says C
            _gate(2, 2, [2.0, 2.1, 0.0, 0.0])]          # a tie: margin 0.1
    vllm = [[x - 9.0 for x in gate[0].logits], [1.0, 2.0, 4.5, 0.0], [2.2, 2.0, 0.0, 0.0]]
    rows = ag.compare(gate, vllm, tie_margin=0.25)
    assert [(r.gate_prediction, r.vllm_prediction, r.agree, r.correct, r.tie) for r in rows] == [
        ("A", "A", True, True, False), ("B", "C", False, False, False), ("B", "A", False, False, True)]
    assert rows[0].score_diff < 1e-6 and rows[0].gate_margin == 2.0
    s1 = ag.log_softmax(vllm[1])
    assert rows[1].vllm_scores == [round(x, 6) for x in s1]
    assert rows[1].score_diff == round(max(abs(a - b) for a, b in zip(ag.log_softmax(gate[1].logits), s1)), 6)
    with pytest.raises(ValueError, match="2 gate answers but 1 vLLM score rows"):
        ag.compare(gate[:2], vllm[:1], 0.25)


def test_summary_and_verdict_name_the_drop():
    gate = [_gate(i, 0, [4.0, 1.0, 0.0, 0.0]) for i in range(8)] + [_gate(8, 1, [0.0, 4.0, 0.0, 0.0]),
                                                                  _gate(9, 0, [3.0, 2.95, 0.0, 0.0])]
    vllm = [list(g.logits) for g in gate[:7]] + [[0.0, 4.0, 0.0, 0.0],     # s/7 flips to B (wrong)
                                                 [0.0, 4.0, 0.0, 0.0],     # s/8 agrees
                                                 [2.9, 3.0, 0.0, 0.0]]     # s/9 a tie that flips
    s = ag.summarize(ag.compare(gate, vllm, 0.25), gate)
    assert (s["n"], s["n_counted"], s["n_ties"], s["n_agree"]) == (10, 9, 1, 8)
    assert s["agreement"] == 8 / 9 and s["agreement_all"] == 0.8
    assert s["disagreements"] == ["s/7"] and s["tie_disagreements"] == ["s/9"]
    assert s["accuracy"] == 0.8 and s["gate_accuracy"] == 1.0       # s/7 and s/9 now wrong
    assert ag.verdict(s, 0.85, 0.5, 0.25) == []
    (msg,) = ag.verdict(s, 0.99, 0.5, 0.25)
    assert msg.startswith("agreement with the gate 0.889 (8/9 questions with gate margin >= 0.25) < "
                          "min_agreement 0.99: vLLM predicts differently on 1 (s/7); served accuracy "
                          "0.800 vs the gate's 1.000 on the same 10 questions (a drop of 0.200)")
    assert ag.verdict(s, 0.5, 0.9, 0.25) == [
        "served accuracy 0.800 (8/10) < min_accuracy 0.9 (the gate's on the same questions: 1.000)"]
    (msg,) = ag.verdict(ag.summarize(ag.compare(gate, vllm, 10.0), gate), 0.5, 0.0, 10.0)
    assert "every one of the 10 questions is a tie" in msg and "stages.vllm_smoke.tie_margin" in msg


def test_defaults_and_pick():
    assert ag.default_min_agreement(quantized=False) == 0.99
    assert ag.default_min_agreement(quantized=True) == 0.95
    assert ag.pick(10, 0) == list(range(10)) and ag.pick(5, 10) == list(range(5))
    assert ag.pick(100, 4) == [0, 25, 50, 75]


def test_gate_answer_from_results_entry():
    g = ag.gate_answer({"answer": "C", "prediction": "B", "logits": [1, 2, 0, 0]}, "x/3")
    assert (g.answer, g.prediction, g.logits) == (2, 1, (1.0, 2.0, 0.0, 0.0))
    with pytest.raises(ValueError, match="question x/3: expected answer, prediction"):
        ag.gate_answer({"answer": "C", "logits": [1, 2, 0, 0]}, "x/3")


# --- the gate's questions, rebuilt ------------------------------------------------------------

def _mmlu_cfg(dataset, **kw):
    from omegaconf import OmegaConf

    from launcher.schema import MmluStage
    return OmegaConf.merge(OmegaConf.structured(MmluStage), {"dataset": dataset, **kw})


def _results(tmp_path, prepared, scfg):
    """A results.json as build_results writes it, with logits computed from the token ids (any
    deterministic numbers do: the test checks they are carried through, not what they are)."""
    qs = []
    for p, ids in zip(prepared.prompts, prepared.token_ids):
        logits = [float((sum(ids) * (k + 1)) % 7) for k in range(4)]
        qs.append({"index": p.question.index, "subject": p.question.subject,
                   "answer": "ABCD"[p.question.answer], "prediction": "ABCD"[ag.argmax(logits)],
                   "logits": logits})
    doc = {"accuracy": 0.5, "lower_bound": 0.4, "dataset": scfg.dataset, "dev_dataset": None,
           "fraction": scfg.fraction, "few_shots": scfg.few_shots, "add_bos": scfg.add_bos,
           "truncated_prompts": prepared.truncated, "questions": qs}
    path = tmp_path / "results.json"
    path.write_text(json.dumps(doc))
    return path, doc


def test_gate_set_is_the_gates_prompts_and_choice_ids(tiny_dir, tmp_path):
    from launcher.mmlu.prompts import choice_token_ids
    from launcher.mmlu.prepared import load_tokenizer, prepare
    from launcher.vllm.gate_questions import GateMismatch, load_gate_set

    tok = load_tokenizer(os.path.join(tiny_dir, "hf"))
    scfg = _mmlu_cfg(os.path.join(tiny_dir, "mmlu", "test.jsonl"), fraction=0.1)
    prepared = prepare(scfg, tok)
    path, doc = _results(tmp_path, prepared, scfg)

    got = load_gate_set(str(path), scfg, tok, 0)
    assert got.token_ids == prepared.token_ids and got.choice_ids == choice_token_ids(tok)
    assert [a.id for a in got.answers] == [f"{q['subject']}/{q['index']}" for q in doc["questions"]]
    assert [a.logits for a in got.answers] == [tuple(q["logits"]) for q in doc["questions"]]
    four = load_gate_set(str(path), scfg, tok, 4)
    n = len(prepared.prompts)
    assert four.token_ids == [prepared.token_ids[i] for i in ag.pick(n, 4)] and four.info["n_gate"] == n

    with pytest.raises(GateMismatch, match=r"stages.mmlu.fraction=0.1 but the config now says 0.2"):
        load_gate_set(str(path), _mmlu_cfg(scfg.dataset, fraction=0.2), tok, 0)
    doc["questions"][1], doc["questions"][2] = doc["questions"][2], doc["questions"][1]
    path.write_text(json.dumps(doc))
    with pytest.raises(GateMismatch, match="they differ from position 1 on: rerun stages.mmlu"):
        load_gate_set(str(path), scfg, tok, 0)
    with pytest.raises(GateMismatch, match="not found: the smoke compares vLLM with the gate"):
        load_gate_set(str(tmp_path / "nope.json"), scfg, tok, 0)


# --- generation checks ------------------------------------------------------------------------

def test_read_checks(tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text('{"prompt": "Q1", "contains": "x"}\n\n{"prompt": "Q2", "expected": "4", "id": "two", '
                 '"chat": false}\n{"prompt": "Q3"}\n')
    got = gen.read_checks(str(p))
    assert [(g.id, g.contains, g.expected, g.chat) for g in got] == [
        ("1", "x", None, None), ("two", None, "4", False), ("4", None, None, None)]
    for line, msg in [('{"prompt": "Q", "expected": "A", "contains": "x"}', "not both"),
                      ('{"expected": "A"}', r"p.jsonl:1: expected an object with a non-empty string 'prompt'"),
                      ('{"prompt": "Q", "contain": "x"}', r"unknown key\(s\) \['contain'\]; valid: prompt"),
                      ('{"prompt": "Q", "chat": "yes"}', "'chat' must be true or false"),
                      ('{"prompt": "Q", "contains": " "}', "'contains' must be a non-empty string")]:
        p.write_text(line + "\n")
        with pytest.raises(ValueError, match=msg):
            gen.read_checks(str(p))


def test_judge_and_verdict():
    paris = gen.GenerationCheck("p", "The capital of France is", contains="paris")
    four = gen.GenerationCheck("f", "2 + 2 =", expected="4")
    free = gen.GenerationCheck("u", "Hello")
    assert gen.judge(paris, " Paris.") is True and gen.judge(paris, " Lyon") is False
    assert gen.judge(four, " 4, of course") is True and gen.judge(four, " four") is False
    assert gen.judge(free, "anything") is None
    s = gen.summarize([paris, four, free], ["a", "b", "c"], [True, False, False], [" Paris.", " 5", ""])
    assert (s["n"], s["n_scored"], s["n_passed"], s["failed"], s["empty_responses"]) == (
        3, 2, 1, ["f"], ["u"])
    assert s["prompts"][0]["rendered"] == "a" and s["prompts"][0]["chat"] is True
    assert gen.verdict(s) == ["1 empty generation(s): u",
                              "generation checks 1/2 passed; failed: f (wanted '4', got ' 5')"]


def test_render_applies_the_chat_template_when_there_is_one(tiny_dir):
    from launcher.mmlu.prepared import load_tokenizer

    tok = load_tokenizer(os.path.join(tiny_dir, "hf"))
    check = gen.GenerationCheck("p", "The capital of France is", contains="Paris")
    assert not gen.has_chat_template(tok)
    ids, text, chat = gen.render(check, tok)
    assert (ids, chat) == (tok.encode(check.prompt), False)
    with pytest.raises(ValueError, match="chat=true but the tokenizer has no chat template"):
        gen.render(gen.GenerationCheck("p", "x", chat=True), tok)
    tok.chat_template = ("{% for m in messages %}<user>{{ m['content'] }}</user>{% endfor %}"
                         "{% if add_generation_prompt %}<bot>{% endif %}")
    ids, text, chat = gen.render(check, tok)
    assert chat and text == "<user>The capital of France is</user><bot>"
    assert ids == tok.encode(text, add_special_tokens=False)
    assert gen.render(gen.GenerationCheck("p", check.prompt, chat=False), tok)[2] is False


# --- config checks (launcher.config.validate._check_vllm) -------------------------------------

TINY = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                    "examples", "tiny", "Qwen3-MoE-tiny", "megatron_lm_ptq.yaml")


@pytest.mark.parametrize("overrides, message", [
    (["stages.vllm_smoke.scoring=echo"], "stages.vllm_smoke.scoring='echo': valid: prompt_logprobs, choice_logprobs"),
    (["stages.vllm_smoke.min_agreement=1.5"], "stages.vllm_smoke.min_agreement=1.5: must be null or satisfy 0 <= min_agreement <= 1"),
    (["stages.vllm_smoke.min_accuracy=-0.1"], "stages.vllm_smoke.min_accuracy=-0.1: must be null or satisfy"),
    (["stages.vllm_smoke.tie_margin=-1"], "stages.vllm_smoke.tie_margin=-1.0: must be >= 0"),
    (["stages.vllm_smoke.questions=-2"], "stages.vllm_smoke.questions=-2: must be >= 0 (0: every question"),
    (["stages.vllm_smoke.max_tokens=0"], "stages.vllm_smoke.max_tokens=0: must be >= 1"),
    (["stages.mmlu.enabled=false"], "stages.vllm_smoke.score_choices=True: compares vLLM with the gate's mmlu/results.json"),
    (["stages.vllm_smoke.score_choices=false"], "stages.vllm_smoke.prompts=None: nothing to check with score_choices=false"),
    (["stages.vllm_smoke.prompts=/nonexistent/checks.jsonl"], "stages.vllm_smoke.prompts='/nonexistent/checks.jsonl': path does not exist"),
])
def test_vllm_config_errors_name_the_key(overrides, message):
    from launcher.config.compose import ConfigError, compose_example
    from launcher.config.validate import validate

    with pytest.raises(ConfigError) as e:
        validate(compose_example(TINY, overrides), check_paths=True)
    assert message in str(e.value)


def test_shipped_generation_checks_validate():
    from launcher.config.compose import compose_example
    from launcher.config.validate import validate

    path = os.path.join(os.path.dirname(gen.__file__), "prompts", "general.jsonl")
    assert [c.contains for c in gen.read_checks(path)][0] == "Paris"
    validate(compose_example(TINY, [f"stages.vllm_smoke.prompts={path}"]), check_paths=False)
