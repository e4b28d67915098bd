"""Nemotron-H on an NVIDIA GPU: Megatron's HybridModel with mamba_ssm's triton kernels vs transformers.

Run on the lent H200 (``bash scripts/gpu_checks.sh $OUT nemotron``): mamba_ssm comes from the
carried pure-Python wheel (no CUDA extension; ``launcher/megatron/mamba_ssm_compat.py``), so the
scan and the gated norm are mamba_ssm's triton kernels (the CPU shims refuse to apply there).

* fp32: logits of the random tiny Nemotron-H (chunk 8, 21 tokens: three scan chunks) equal
  transformers' on the same GPU; transformers' reference at one chunk, because its naive Mamba
  path is wrong across chunks (tests/test_nemotron_h_model.py); the measured figure is printed.
* bf16 (the pipeline's dtype, through Float16Module): the same argmax as transformers' fp32 at
  >= 95% of the positions whose fp32 top-2 margin exceeds 0.05 (bf16 logits of this model move
  by up to 0.33: measured 29 of 30 positions on the H200).
"""
from __future__ import annotations

import json
import os

import pytest

from launcher_testing.checkpoints import hf_logits, write_tiny_nemotron_h
from launcher_testing.ranks import run_on_ranks

pytestmark = pytest.mark.gpu
FRESH_RANKS = True   # hybrid ranks: the Mamba stub must precede mamba_mixer's first import (a pooled worker may have done it)
torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs an NVIDIA GPU", allow_module_level=True)

SEQ = 21
FP32_TOLERANCE = 1e-4     # max |megatron - transformers| in fp32 (H200, 2026-12-02: 1.8e-6)
BF16_AGREEMENT = 0.95     # argmax agreement at clear positions in bf16 (H200, 2026-12-02: 29 of 30)


def gpu_worker(hf_path: str) -> dict:
    import torch

    from launcher.megatron.dist import init_distributed, shutdown
    from launcher.megatron.forward import forward_logits
    from launcher.megatron.hf_io import import_hf_weights
    from launcher.megatron.models import build_model, unwrap_model
    from launcher.topology import ParallelDims

    dims = ParallelDims(world_size=1)
    init_distributed(dims, "cuda", timeout_s=120, seed=1234, architecture="NemotronHForCausalLM")
    import megatron.core.ssm.mamba_mixer as mixer

    tokens = torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(3))
    reference = hf_logits(hf_path, tokens.cuda(), chunk_size=128, device_map="cuda").float().cpu()
    out = {"scan_kernel": f"{mixer.mamba_chunk_scan_combined.__module__}.{mixer.mamba_chunk_scan_combined.__name__}"}
    for dtype in ("float32", "bfloat16"):
        model = build_model(hf_path, dims, "cuda", dtype, "alltoall")
        import_hf_weights(model, hf_path, dtype)
        logits = forward_logits(model, tokens).float().cpu()
        out[dtype] = {"max_abs_diff": float((logits - reference).abs().max()),
                      "reference_max": float(reference.abs().max()),
                      "wrapper": type(model).__name__, "inner": type(unwrap_model(model)).__name__}
        top2 = reference.topk(2, dim=-1).values
        clear = (top2[..., 0] - top2[..., 1]) > 0.05
        same = logits.argmax(-1) == reference.argmax(-1)
        out[dtype].update(clear_positions=int(clear.sum()), clear_argmax_equal=int((same & clear).sum()))
        del model
    shutdown()
    return out


def test_gpu_nemotron_h_logits_match_transformers(tmp_path):
    path = write_tiny_nemotron_h(str(tmp_path / "nemotron_h"), pattern="MEM*EMEM")
    [r] = run_on_ranks("test_gpu_nemotron_h:gpu_worker", nprocs=1, kwargs={"hf_path": path}, timeout_s=600)
    print(json.dumps(r, indent=1))
    report = os.environ.get("GPU_REPORT_DIR")
    if report:
        with open(os.path.join(report, "nemotron_h_logits.json"), "w") as f:
            json.dump(r, f, indent=1)
    assert r["scan_kernel"].startswith("mamba_ssm.ops.triton"), "the GPU must run mamba_ssm's triton scan"
    assert r["float32"]["inner"] == "HybridModel" and r["bfloat16"]["wrapper"] == "Float16Module"
    assert r["float32"]["max_abs_diff"] < FP32_TOLERANCE, r["float32"]
    assert r["bfloat16"]["clear_positions"] > 0, r["bfloat16"]
    assert r["bfloat16"]["clear_argmax_equal"] >= BF16_AGREEMENT * r["bfloat16"]["clear_positions"], r["bfloat16"]
