"""Unit tests of launcher.vllm's pure parts: capability decisions, export reading, engine-arg
parsing, and process-group cleanup (a real `sh`/`sleep` tree, no vLLM).  Choice agreement and
generation checks: tests/test_vllm_agreement.py."""
from __future__ import annotations

import json
import os
import sys
import time

import pytest

from launcher.vllm import capability as cap
from launcher.vllm.offline_engine import engine_kwargs
from launcher.vllm.procs import GroupProcess, descendants, error_line

CPU_VLLM = cap.Platform(python="/v/bin/python", vllm_importable=True, vllm_version="0.32.0",
                        vllm_device="cpu")
NO_VLLM = cap.Platform(python="/v/bin/python", vllm_importable=False,
                       vllm_error="ModuleNotFoundError: No module named 'vllm'")


def gpu(*caps, names=("NVIDIA H200",)):
    return cap.Platform(python="py", vllm_importable=True, vllm_version="0.32.0",
                        vllm_device="cuda", gpu_capabilities=tuple(caps), gpu_names=names)


NONE = cap.QuantInfo(algo=None)
NVFP4 = cap.QuantInfo(algo="NVFP4", source="hf_quant_config.json")
FP8 = cap.QuantInfo(algo="FP8", source="hf_quant_config.json")


def write_export(tmp_path, hf_quant=None, quant_config=None, name="exp"):
    d = tmp_path / name
    d.mkdir()
    config = {"architectures": ["Qwen3MoeForCausalLM"], "head_dim": 32}
    if quant_config is not None:
        config["quantization_config"] = quant_config
    (d / "config.json").write_text(json.dumps(config))
    if hf_quant is not None:
        (d / "hf_quant_config.json").write_text(json.dumps(hf_quant))
    return str(d)


# --- decide -----------------------------------------------------------------------------------

@pytest.mark.parametrize("platform", [CPU_VLLM, gpu((9, 0)), gpu((8, 0))])
def test_unquantized_serves_wherever_vllm_runs(platform):
    ok, reason = cap.decide(NONE, platform)
    assert ok, reason
    assert "unquantized" in reason


def test_vllm_missing_is_refused_with_the_import_error():
    ok, reason = cap.decide(NONE, NO_VLLM)
    assert not ok
    assert "not importable in /v/bin/python" in reason and "No module named 'vllm'" in reason


@pytest.mark.parametrize("platform,ok", [
    (CPU_VLLM, False), (gpu(), False), (gpu((9, 0)), False), (gpu((8, 9)), False),
    (gpu((10, 0)), True), (gpu((12, 0)), True), (gpu((9, 0), (10, 0)), True)])
def test_nvfp4_needs_blackwell(platform, ok):
    got, reason = cap.decide(NVFP4, platform)
    assert got is ok, reason
    if not ok:
        assert "Blackwell" in reason and "NVFP4" in reason


@pytest.mark.parametrize("platform,ok", [
    (CPU_VLLM, False), (gpu(), False), (gpu((8, 6)), False), (gpu((8, 9)), True), (gpu((9, 0)), True)])
def test_fp8_needs_a_gpu_with_cc_8_9(platform, ok):
    got, reason = cap.decide(FP8, platform)
    assert got is ok, reason


def test_cpu_build_refuses_quantized_even_with_a_gpu_present():
    platform = cap.Platform(python="py", vllm_importable=True, vllm_version="0.32.0",
                            vllm_device="cpu", gpu_capabilities=((10, 0),))
    ok, reason = cap.decide(NVFP4, platform)
    assert not ok and "CPU build" in reason


def test_reasons_name_the_gpu_and_capability():
    ok, reason = cap.decide(NVFP4, gpu((9, 0)))
    assert not ok and "9.0" in reason and "H200" in reason
    ok, reason = cap.decide(FP8, gpu())
    assert not ok and "no CUDA GPU" in reason


def test_fp8_kv_cache_alone_needs_a_gpu():
    kv = cap.QuantInfo(algo=None, kv_cache_algo="FP8")
    assert kv.quantized
    assert not cap.decide(kv, CPU_VLLM)[0]
    assert cap.decide(kv, gpu((9, 0)))[0]


def test_mixed_precision_takes_the_strictest_layer():
    mixed = cap.QuantInfo(algo="MIXED_PRECISION", layer_algos=("FP8", "NVFP4"))
    assert not cap.decide(mixed, gpu((9, 0)))[0]
    assert cap.decide(mixed, gpu((10, 0)))[0]


def test_unknown_quantized_format_needs_some_gpu():
    awq = cap.QuantInfo(algo="INT4_AWQ")
    assert not cap.decide(awq, CPU_VLLM)[0]
    assert cap.decide(awq, gpu((8, 0)))[0]


@pytest.mark.parametrize("algo,family", [
    ("NVFP4", "nvfp4"), ("NVFP4_AWQ", "nvfp4"), ("W4A16_NVFP4", "nvfp4"), ("W4A8_NVFP4_FP8", "nvfp4"),
    ("FP8", "fp8"), ("FP8_PB_WO", "fp8"), ("W4A8_MXFP4_FP8", "fp8"), ("INT4_AWQ", "other"),
    ("MXFP4", "other")])
def test_families(algo, family):
    assert cap._family(algo) == family


# --- read_quant_info --------------------------------------------------------------------------

def test_read_unquantized(tmp_path):
    info = cap.read_quant_info(write_export(tmp_path))
    assert not info.quantized and info.describe() == "unquantized"


def test_read_modelopt_hf_quant_config(tmp_path):
    d = write_export(tmp_path, hf_quant={"producer": {"name": "modelopt"}, "quantization": {
        "quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16}},
        quant_config={"quant_method": "modelopt", "quant_algo": "NVFP4"})
    info = cap.read_quant_info(d)
    assert info.algo == "NVFP4" and info.kv_cache_algo is None and info.source == "hf_quant_config.json"


def test_read_quantization_config_only(tmp_path):
    d = write_export(tmp_path, quant_config={
        "quant_method": "modelopt", "quant_algo": "FP8",
        "kv_cache_scheme": {"dynamic": False, "num_bits": 8, "type": "float"}})
    info = cap.read_quant_info(d)
    assert (info.algo, info.kv_cache_algo) == ("FP8", "FP8")
    assert "quantization_config" in info.source


def test_read_other_producer_uses_quant_method(tmp_path):
    d = write_export(tmp_path, quant_config={"quant_method": "compressed-tensors", "config_groups": {}})
    assert cap.read_quant_info(d).algo == "COMPRESSED-TENSORS"


def test_read_mixed_precision_layers(tmp_path):
    d = write_export(tmp_path, hf_quant={"quantization": {"quant_algo": "MIXED_PRECISION", "quantized_layers": {
        "a": {"quant_algo": "FP8"}, "b": {"quant_algo": "NVFP4", "group_size": 16}}}})
    assert cap.read_quant_info(d).layer_algos == ("FP8", "NVFP4")


def test_read_missing_config_names_the_path(tmp_path):
    with pytest.raises(cap.ExportConfigError, match="config.json not found"):
        cap.read_quant_info(str(tmp_path))


def test_read_broken_json(tmp_path):
    d = write_export(tmp_path)
    with open(os.path.join(d, "hf_quant_config.json"), "w") as f:
        f.write("{nope")
    with pytest.raises(cap.ExportConfigError, match="unreadable JSON"):
        cap.read_quant_info(d)


# --- offline engine args ----------------------------------------------------------------------

def test_engine_kwargs():
    assert engine_kwargs(["--max-model-len", "512", "--trust-remote-code", "--dtype=bfloat16",
                          "--gpu-memory-utilization", "0.5"]) == {
        "max_model_len": 512, "trust_remote_code": True, "dtype": "bfloat16",
        "gpu_memory_utilization": 0.5}


# --- process groups ---------------------------------------------------------------------------

def test_group_process_stop_kills_children_that_ignore_sigterm(tmp_path):
    # a parent that ignores SIGTERM, with a child in its own session (escapes the group)
    script = ("import os, signal, subprocess, sys, time\n"
              "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
              "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'], start_new_session=True)\n"
              "print('re' + 'ady', flush=True); time.sleep(300)\n")
    log = tmp_path / "log.txt"
    p = GroupProcess([sys.executable, "-c", script], str(log))
    deadline = time.time() + 30
    while "ready\n" not in log.read_text() and time.time() < deadline:
        time.sleep(0.1)
    assert p.poll() is None
    kids = descendants(p.pid)
    assert kids, "the child should be visible in /proc"
    killed = p.stop(grace_s=1.0)
    assert p.pid in killed                       # needed SIGKILL
    for pid in [p.pid, *kids]:
        assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split(") ")[1][0] == "Z"
    assert "$ " in log.read_text()


def test_error_line_picks_the_last_error():
    lines = ["INFO fine", "Traceback (most recent call last):", "  File x", "ValueError: Failed to find a kernel",
             "INFO shutting down"]
    assert error_line(lines) == "ValueError: Failed to find a kernel"
    assert error_line(["all good"]) is None


def test_without_vllm_a_format_no_gpu_here_can_serve_names_the_format_first():
    """`make demo` (no .venv-vllm): the skip says NVFP4 needs a Blackwell GPU before it says vLLM is
    missing, and how to get the real smoke; an unquantized export keeps the import error alone."""
    ok, reason = cap.decide(NVFP4, NO_VLLM)
    assert not ok
    assert reason.startswith("NVFP4 [hf_quant_config.json] needs a Blackwell GPU (compute capability >= 10.0); "
                             "no CUDA GPU is visible, so no vLLM build can serve it here (and vLLM is not "
                             "importable in /v/bin/python")
    assert reason.endswith("run `make vllm-env`, then the example with recipe=none")
    ok, reason = cap.decide(FP8, cap.Platform(python="/v/bin/python", vllm_importable=False,
                                              gpu_capabilities=((9, 0),), gpu_names=("NVIDIA H200",)))
    assert not ok and reason.startswith("vLLM is not importable")   # an H200 serves FP8: vLLM is what is missing
