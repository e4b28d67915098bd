"""benchmarks/nano_width.py's model: widths read from the Nano card (not copied), the pattern cut
as asked, and the parameter counts the report's throughput and MFU are computed from."""
import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("nano_width", ROOT / "benchmarks" / "nano_width.py")
nw = importlib.util.module_from_spec(spec)
spec.loader.exec_module(nw)
CARD = nw.read_card()


def test_patterns_are_the_cards_prefix_or_a_valid_pattern():
    assert nw.resolve_pattern("13", CARD["hybrid_override_pattern"]) == CARD["hybrid_override_pattern"][:13]
    assert nw.resolve_pattern("MEM*E", CARD["hybrid_override_pattern"]) == "MEM*E"
    with pytest.raises(ValueError, match=r"--patterns: 'MEX' has \['X'\]; valid layer letters: M \(Mamba-2\)"):
        nw.resolve_pattern("MEX", CARD["hybrid_override_pattern"])
    with pytest.raises(ValueError, match="--patterns: 53 layers asked, the card's pattern has 52"):
        nw.resolve_pattern("53", CARD["hybrid_override_pattern"])


@pytest.mark.torch
def test_model_has_the_cards_widths_and_counts_its_experts():
    import torch
    import transformers

    class Tok:
        bos_token_id, eos_token_id, pad_token_id = 1, 2, 2

    config = nw.nano_config(CARD, "MEM*E", 151680, Tok())
    for key in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "mamba_num_heads",
                "mamba_head_dim", "n_groups", "ssm_state_size", "n_routed_experts", "num_experts_per_tok",
                "moe_intermediate_size", "moe_shared_expert_intermediate_size", "tie_word_embeddings"):
        assert getattr(config, key) == CARD[key], key
    assert config.num_hidden_layers == 5 and config.vocab_size == 151680
    with torch.device("meta"):
        model = transformers.NemotronHForCausalLM(config)
    counts = nw.param_counts(model, CARD["num_experts_per_tok"], CARD["n_routed_experts"])
    # two E layers, each 128 relu2 experts of an up and a down projection
    experts = 2 * CARD["n_routed_experts"] * 2 * CARD["hidden_size"] * CARD["moe_intermediate_size"]
    assert counts["routed_experts"] == experts
    assert counts["embedding"] == 151680 * CARD["hidden_size"]
    assert counts["active_non_embedding"] == counts["total"] - counts["embedding"] - experts + experts * 6 // 128


def _run(root: Path, name: str, status: str, mtime: int) -> Path:
    import json
    import os

    d = root / "nano-width-5" / name
    d.mkdir(parents=True)
    (d / "metadata.json").write_text(json.dumps({"status": status}))
    os.utime(d, (mtime, mtime))
    return d


def test_a_later_call_reuses_the_newest_completed_run(tmp_path):
    assert nw.completed_run(str(tmp_path), "nano-width-5") is None
    done = _run(tmp_path, "a", "completed", 100)
    _run(tmp_path, "b", "failed", 200)
    (tmp_path / "nano-width-5" / "c").mkdir()                    # no metadata.json: not a run
    assert nw.completed_run(str(tmp_path), "nano-width-5") == str(done)
    newer = _run(tmp_path, "d", "completed", 300)
    assert nw.completed_run(str(tmp_path), "nano-width-5") == str(newer)


def test_the_smoke_resumes_the_pipelines_own_launch(tmp_path):
    """The smoke's launch is the pipeline's, the smoke enabled: the plan it validates has the three
    stages as the pipeline had them, plus the smoke (offline, on one rank)."""
    import argparse
    import json
    import subprocess
    import sys

    hf = tmp_path / "hf"
    hf.mkdir()
    (tmp_path / "calib.jsonl").write_text('{"text": "a"}\n')
    args = argparse.Namespace(calib_size=8, calib_len=512, fraction=0.01, device="cuda", overrides=[])
    base = nw.launch_argv(str(hf), "MEM*E", {"vocab": 151680}, str(tmp_path / "calib.jsonl"),
                          str(tmp_path / "runs"), "nano-width-5", args, ["stages.vllm_smoke.enabled=false"])
    assert "stages.vllm_smoke.nvfp4_kernels=auto" in nw.smoke_argv(base, "/opt/vllm/bin/python", "RUN")
    cmd = nw.smoke_argv(base, "/opt/vllm/bin/python", "RUN", "emulation")
    assert cmd[-2:] == ["--resume", "RUN"] and "stages.vllm_smoke.enabled=false" not in cmd
    assert "stages.vllm_smoke.nvfp4_kernels=emulation" in cmd and "stages.vllm_smoke.mode=offline" in cmd
    server = nw.smoke_argv(base, "/opt/vllm/bin/python", "RUN", "auto", "server")
    assert "stages.vllm_smoke.mode=server" in server and "stages.vllm_smoke.mode=offline" not in server
    assert cmd.count("stages.vllm_smoke.enabled=true") == 1 and "stages.vllm_smoke.python=/opt/vllm/bin/python" in cmd
    plan = subprocess.run(cmd[:-2] + ["--dry-run", "--json"], cwd=ROOT, capture_output=True, text=True)
    assert plan.returncode == 0, plan.stderr
    stages = {s["name"]: s for s in json.loads(plan.stdout)["stages"]}
    assert [n for n, s in stages.items() if s["enabled"]] == ["quantize", "mmlu", "export", "vllm_smoke"]
    assert stages["vllm_smoke"]["world_size"] == 1


def test_report_takes_rank0s_profile_of_each_profiled_stage(tmp_path):
    (tmp_path / "export").mkdir()
    (tmp_path / "export" / "profile-rank0.txt").write_text("".join(f"line {i}\n" for i in range(100)))
    (tmp_path / "export" / "profile-rank1.txt").write_text("rank 1\n")
    got = nw.read_profiles(str(tmp_path), "export,mmlu", lines=3)
    assert got == {"export": {"path": str(tmp_path / "export" / "profile-rank0.txt"),
                              "top": ["line 0", "line 1", "line 2"]}}
    assert nw.read_profiles(str(tmp_path), "") == {}


def test_a_reused_run_resumes_with_the_launch_it_was_made_with(tmp_path):
    """On the H100 (2026-12-06) the nano-vllm job ran from another repo copy than the nano job: its
    fresh argv named another MMLU path, the resume redid the gate, then export refused to overwrite."""
    import json

    made = ["python", "-m", "launcher.cli", "nano.yaml", "stages.mmlu.dataset=/tmp/gpu-bg/nano/repo/.bench/mmlu/test.jsonl"]
    fresh = made[:-1] + ["stages.mmlu.dataset=/tmp/gpu-bg/nanovllm/repo/.bench/mmlu/test.jsonl"]
    path = tmp_path / "nano-width-5.launch.json"
    assert nw.recorded_launch(str(path), fresh) == fresh          # nothing recorded: the fresh one
    path.write_text(json.dumps(made))
    assert nw.recorded_launch(str(path), fresh) == made


def test_a_pattern_that_would_fill_the_disk_is_refused_with_the_numbers(tmp_path):
    params = 7_580_000_000                       # Nano's first 13 layers
    with pytest.raises(nw.NotEnoughDisk) as e:
        nw.check_disk(str(tmp_path), params, free=20 * 10**9)
    assert str(e.value).startswith(f"--work {tmp_path}: 20.0 GB free, a 7.58 B-parameter pattern needs about "
                                   "37.9 GB (2.5x its 15.2 GB bf16 checkpoint: the source, quantize's checkpoint, "
                                   "the export)")
    assert nw.check_disk(str(tmp_path), params, free=38 * 10**9) == 37_900_000_000


def test_a_model_trained_otherwise_is_named_otherwise():
    """The folder and job of a trained model name its steps, batch and rate: a later call on the host that
    trains with other settings builds its own model instead of reusing a run of another one."""
    import argparse

    def suffix(steps, batch=4, lr=2e-4, until=0.9):
        return nw.trained_suffix(argparse.Namespace(train_steps=steps, train_batch=batch, train_lr=lr,
                                                    train_until=until))

    assert suffix(0) == ""
    assert suffix(300) == "-trained300x4-lr0.0002-until0.9"
    assert suffix(300, until=0) == "-trained300x4-lr0.0002"
    assert len({suffix(300), suffix(300, batch=1), suffix(300, lr=5e-4), suffix(200), suffix(300, until=0.5),
                suffix(300, until=0)}) == 6


def test_a_model_built_and_trained_by_a_call_cut_off_in_its_launch_is_reused(tmp_path):
    """A call whose launch ran out of time leaves its built (and trained) model: the next call on the host
    launches it again instead of building and training anew; a model whose training did not finish
    (no ``answers`` written) is built again."""
    import argparse

    model_json = tmp_path / "nano_width_model.json"
    trained, untrained = (argparse.Namespace(train_steps=n) for n in (300, 0))
    assert nw.ready_model(str(model_json), trained) is None and nw.ready_model(str(model_json), untrained) is None
    model_json.write_text(json.dumps({"pattern": "MEM*E", "vocab": 151680}))
    assert nw.ready_model(str(model_json), trained) is None
    assert nw.ready_model(str(model_json), untrained) == {"pattern": "MEM*E", "vocab": 151680}
    model_json.write_text(json.dumps({"pattern": "MEM*E", "answers": {"steps_run": 150}}))
    assert nw.ready_model(str(model_json), trained)["answers"] == {"steps_run": 150}


def test_each_kernel_choice_keeps_its_own_verdict_and_files(tmp_path, monkeypatch):
    """serve_with_vllm serves the export once per --vllm-kernels choice, each a launch --resume that writes
    vllm_smoke/responses.json and log.txt again: each choice's comparison with the gate (less its
    per-question list) is in the report, and its files are kept under its own name (the run of
    2026-12-07 lost emulation's score differences to auto's, which came second). The launches are
    injected: each writes what the smoke writes."""
    import argparse
    import subprocess

    run = tmp_path / "run"
    (run / "vllm_smoke").mkdir(parents=True)
    diffs = {"emulation": 0.01, "auto": 0.13, "emulation-server": 0.02, "auto-server": 0.14}

    def fake_launch(cmd, timeout, env=None):
        kind = next(a.split("=", 1)[1] for a in cmd if a.startswith("stages.vllm_smoke.nvfp4_kernels="))
        mode = next(a.split("=", 1)[1] for a in cmd if a.startswith("stages.vllm_smoke.mode="))
        kind += "" if mode == "offline" else f"-{mode}"
        choices = {"agreement": 1.0, "median_score_diff": diffs[kind], "questions": [{"id": "q1"}]}
        (run / "vllm_smoke" / "responses.json").write_text(json.dumps(
            {"passed": True, "agreement": 1.0, "kernels": {"family": kind}, "choices": choices}))
        (run / "vllm_smoke" / "log.txt").write_text(f"engine log of {kind}\n")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(nw, "run_launch", fake_launch)
    args = argparse.Namespace(vllm="/opt/vllm/bin/python", vllm_kernels="emulation,auto", timeout=60,
                              vllm_modes="offline,server")
    served = nw.serve_with_vllm(["python", "-m", "launcher.cli", nw.NANO], str(run), args)
    assert list(served) == ["emulation", "auto", "emulation-server", "auto-server"]
    for kind, diff in diffs.items():
        assert served[kind]["exit"] == 0 and served[kind]["responses"]["kernels"] == {"family": kind}
        assert served[kind]["responses"]["choices"] == {"agreement": 1.0, "median_score_diff": diff}
        kept = json.loads((run / "vllm_smoke" / f"responses-{kind}.json").read_text())
        assert kept["choices"]["median_score_diff"] == diff and kept["choices"]["questions"] == [{"id": "q1"}]
        assert (run / "vllm_smoke" / f"log-{kind}.txt").read_text() == f"engine log of {kind}\n"
