"""benchmarks/_answer_training.py on CPU: a random tiny Qwen3-MoE (the tiny build's config and tokenizer,
fresh weights) trained on the tiny example gate's own prompts becomes decisive and right on them; the
routed experts stay as they were; the same seed gives the same losses. (At Nano width it runs on the
GPU: benchmarks/nano_width.py --train-steps.)"""
from __future__ import annotations

import json
import os

import pytest

from benchmarks._answer_training import GatePrompts, choice_logits, prompts_for, train_answers, trainable

pytestmark = pytest.mark.torch
torch = pytest.importorskip("torch")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_EXAMPLE = os.path.join(ROOT, "examples", "tiny", "Qwen3-MoE-tiny", "megatron_lm_ptq.yaml")


@pytest.fixture(scope="module")
def gate_prompts(tiny_dir):
    import transformers

    from launcher.config.compose import compose_example

    cfg = compose_example(TINY_EXAMPLE, [f"model.path={tiny_dir}/hf"])
    prompts = prompts_for(cfg.stages.mmlu, transformers.AutoTokenizer.from_pretrained(f"{tiny_dir}/hf"))
    assert len(prompts.answers) == 320 and set(prompts.answers) == {0, 1, 2, 3}
    n = 24    # the first 24 of the gate's questions: enough to see it learn, quick on CPU
    return GatePrompts(prompts.token_ids[:n], prompts.answers[:n], prompts.choice_ids, prompts.pad_id)


def _random_model(tiny_dir):
    import transformers

    config = transformers.AutoConfig.from_pretrained(f"{tiny_dir}/hf")
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).float()


def test_choice_logits_are_the_full_logits_choice_columns(tiny_dir, tmp_path):
    """choice_logits (the last hidden state times the output embedding's four choice rows) equals the
    model's own full logits at each prompt's last position, choice columns, for a right-padded batch:
    a Qwen3-MoE and a NemotronH (Mamba-2, attention, MoE), both random, in float32."""
    import transformers

    from launcher_testing.checkpoints import write_tiny_nemotron_h

    nemotron = transformers.AutoModelForCausalLM.from_pretrained(
        write_tiny_nemotron_h(str(tmp_path / "nemotron"), pattern="MEM*E"), torch_dtype=torch.float32)
    prompts = GatePrompts([[5, 6, 7, 8, 9, 10, 11], [12, 13, 14]], [0, 1], [20, 21, 22, 23], pad_id=0)
    for model in (_random_model(tiny_dir).eval(), nemotron.eval()):
        with torch.no_grad():
            got = choice_logits(model, prompts, [0, 1], "cpu")
            want = torch.stack([model(input_ids=torch.tensor([ids])).logits[0, -1, prompts.choice_ids]
                                for ids in prompts.token_ids])
        assert got.shape == (2, 4)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_only_the_routed_experts_are_frozen():
    assert not trainable("backbone.layers.1.mixer.experts.17.up_proj.weight")
    assert not trainable("model.layers.0.mlp.experts.3.gate_proj.weight")
    assert trainable("backbone.layers.1.mixer.shared_experts.up_proj.weight")
    assert trainable("backbone.layers.1.mixer.gate.weight") and trainable("lm_head.weight")


def test_a_random_model_learns_the_gates_answers(tiny_dir, gate_prompts):
    model = _random_model(tiny_dir)
    experts = {n: p.detach().clone() for n, p in model.named_parameters() if not trainable(n)}
    others = {n: p.detach().clone() for n, p in model.named_parameters() if trainable(n)}
    assert experts and others
    figures = train_answers(model, gate_prompts, steps=60, lr=1e-3, batch_size=8, seed=0, log=lambda _m: None)
    assert figures["before"]["accuracy"] < 0.6
    assert figures["after"]["accuracy"] == 1.0, figures["after"]
    assert figures["after"]["median_margin"] > 1.0 > figures["before"]["median_margin"], figures
    assert min(figures["losses"][-5:]) < figures["losses"][0] / 4, figures["losses"]
    params = dict(model.named_parameters())
    assert all(torch.equal(params[n], t) for n, t in experts.items())
    assert sum(not torch.equal(params[n], t) for n, t in others.items()) > len(others) // 2
    assert not any(p.requires_grad for p in model.parameters())   # left as an inference model

    again = train_answers(_random_model(tiny_dir), gate_prompts, steps=5, lr=1e-3, batch_size=8, seed=0,
                          log=lambda _m: None)
    assert again["losses"] == figures["losses"][:5]


def test_training_stops_at_the_first_check_that_reaches_the_accuracy(tiny_dir, gate_prompts):
    """``until_accuracy``: evaluated every ``check_every`` steps, stopped at the first check that reaches
    it; ``steps`` is only the most it may run, and the figures after are the last check's."""
    figures = train_answers(_random_model(tiny_dir), gate_prompts, steps=200, lr=1e-3, batch_size=8, seed=0,
                            log=lambda _m: None, until_accuracy=1.0, check_every=10)
    checks = figures["checks"]
    assert checks and [c["step"] for c in checks] == list(range(10, 10 * len(checks) + 1, 10))
    assert checks[-1]["accuracy"] == 1.0 and all(c["accuracy"] < 1.0 for c in checks[:-1]), checks
    assert figures["steps_run"] == len(figures["losses"]) == checks[-1]["step"] < 200
    assert figures["after"] == {k: checks[-1][k] for k in figures["after"]}
    assert sum(checks[-1]["chosen"]) == len(gate_prompts.answers)


def test_bad_training_settings_are_refused(tiny_dir, gate_prompts):
    with pytest.raises(ValueError, match="steps, batch_size and check_every must be >= 1, got 0, 8, 50"):
        train_answers(_random_model(tiny_dir), gate_prompts, steps=0, lr=1e-3, batch_size=8)
    with pytest.raises(ValueError, match=r"until_accuracy must be in \(0, 1\], got 1.5"):
        train_answers(_random_model(tiny_dir), gate_prompts, steps=5, lr=1e-3, batch_size=8, until_accuracy=1.5)


def test_nano_width_trains_its_saved_model_on_the_nano_gates_questions(tmp_path, monkeypatch):
    """benchmarks/nano_width.py's training step, as its ``nano`` part runs it on the GPU but on CPU and
    a random tiny NemotronH (Nano's family, saved in bf16 as at Nano width): the questions are the Nano
    example's gate's at the launch's own fraction; the model saved in place is the trained one (trained in
    float32, saved with every tensor's dtype as before, routed experts untouched)."""
    import argparse

    import transformers
    from safetensors.torch import load_file

    from benchmarks import nano_width
    from launcher_testing.checkpoints import write_tiny_nemotron_h

    mmlu = os.environ.get("PTQ_MMLU_JSONL") or os.path.join(ROOT, "..", "shared", "data", "mmlu", "test.jsonl")
    if not os.path.exists(mmlu):
        pytest.skip(f"no MMLU test split at {mmlu}")
    rows, subjects = [], set()
    with open(mmlu) as f:                       # the first question of each of 12 subjects: quick on CPU
        for line in f:
            subject = json.loads(line)["subject"]
            if subject not in subjects and len(subjects) < 12:
                subjects.add(subject)
                rows.append(line)
    (tmp_path / "mmlu.jsonl").write_text("".join(rows))
    monkeypatch.setattr(nano_width, "MMLU_JSONL", str(tmp_path / "mmlu.jsonl"))
    hf = write_tiny_nemotron_h(str(tmp_path / "nano"), pattern="MEM*E")
    transformers.AutoModelForCausalLM.from_pretrained(hf, torch_dtype=torch.bfloat16).save_pretrained(hf)
    before = load_file(os.path.join(hf, "model.safetensors"))
    args = argparse.Namespace(calib_size=8, calib_len=64, fraction=0.002, device="cpu", overrides=[],
                              train_steps=3, train_lr=2e-4, train_batch=8, train_until=0.0)
    launch = nano_width.launch_argv(hf, "MEM*E", {"vocab": 257}, str(tmp_path / "calib.jsonl"),
                                    str(tmp_path / "runs"), "nano-width-5-trained3", args, [])
    figures = nano_width.train_saved_model(hf, launch, args)

    from launcher.config.compose import compose_example
    from launcher.mmlu.prepared import prepare

    cfg = compose_example(os.path.join(ROOT, nano_width.NANO), launch[launch.index(nano_width.NANO) + 1:])
    asked = len(prepare(cfg.stages.mmlu, transformers.AutoTokenizer.from_pretrained(hf)).prompts)
    assert asked == 12 and figures["before"]["n"] == figures["after"]["n"] == asked
    assert len(figures["losses"]) == 3 and figures["trained_params"] > 0
    assert sum(figures["after"]["chosen"]) == asked      # the argmax counts that show a one-letter model
    after = load_file(os.path.join(hf, "model.safetensors"))
    assert set(after) == set(before) and all(after[n].dtype == before[n].dtype for n in before)
    assert after["lm_head.weight"].dtype == torch.bfloat16
    experts = [n for n in before if not trainable(n)]
    assert experts and all(torch.equal(after[n], before[n]) for n in experts)
    assert any(not torch.equal(after[n], before[n]) for n in before if trainable(n))
