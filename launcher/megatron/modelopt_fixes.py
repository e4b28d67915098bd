"""Fixes for nvidia-modelopt bugs that change exported values (every device, not CPU shims).

``fp8_export_single_rounding`` - ModelOpt 0.47's Megatron exporter
(``modelopt.torch.export.unified_export_megatron``) casts each weight to the export dtype
(bf16) and then quantizes it with ``(weight / scale).to(float8_e4m3fn)``.  For per-tensor FP8
the scale is a 0-dim fp32 tensor, and PyTorch's type promotion keeps a dimensioned bf16 tensor
divided by a 0-dim fp32 tensor in bf16: every FP8 code is rounded twice (to bf16, then to FP8).
The fake quantization the MMLU gate evaluated rounds once, from fp32.  Measured:

* on the H200 (2026-12-02, tiny Qwen3-MoE in bf16, FP8_DEFAULT_CFG): 2.4-3.0% of the elements of
  every sampled module came out one FP8 step off the gate's fake-quantized weights
  (``tests/test_export_stage.py::test_gpu_quantize_then_export_verifies`` failed on them);
* on CPU (``pytest -s tests/test_modelopt_fixes.py`` prints both): 2.15% of the FP8 codes of a
  512x512 bf16 N(0, 0.02) weight; a bf16 export of an FP8-quantized tiny Qwen3-MoE: 7,267 of
  262,656 compared elements (2.77%) one step off, 55 of 57 modules failing verification; 0
  with the fix.

The exporter does this arithmetic on CPU tensors (``module.weight.to(dtype).cpu()``) whichever
device the model is on, so the CPU tests cover the GPU path.  The fix upcasts the (exact) bf16/fp16
weight to fp32 before the division - the single rounding the fake quant uses.  CPU runs of this
project export in fp32 and were never affected.  ``tests/test_modelopt_fixes.py`` asserts the bug
is still present in the installed ModelOpt, so an upstream fix shows up as a failing test that
says to delete this module.
"""
from __future__ import annotations

_APPLIED: set[str] = set()


def _fp8_export_single_rounding() -> None:
    import torch
    import modelopt.torch.export.unified_export_megatron as exporter
    from modelopt.torch.export.model_config import QUANTIZATION_FP8

    original = exporter.to_quantized_weight

    def to_quantized_weight(weight, weights_scaling_factor, quantization, *args, **kwargs):
        if (quantization == QUANTIZATION_FP8 and weights_scaling_factor is not None
                and weights_scaling_factor.dim() == 0 and weight.dtype in (torch.bfloat16, torch.float16)):
            weight = weight.float()
        return original(weight, weights_scaling_factor, quantization, *args, **kwargs)

    to_quantized_weight.__wrapped__ = original
    exporter.to_quantized_weight = to_quantized_weight


FIXES = {"fp8_export_single_rounding": _fp8_export_single_rounding}


def apply_modelopt_fixes() -> list[str]:
    """Install every fix once (idempotent); returns the names applied so far."""
    for name, fix in FIXES.items():
        if name not in _APPLIED:
            fix()
            _APPLIED.add(name)
    return sorted(_APPLIED)
