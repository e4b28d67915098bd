"""Fixes for nvidia-modelopt bugs (every device, not CPU shims), each registered in ``FIXES``.

``fp8_export_single_rounding`` - ModelOpt 0.47's Megatron exporter
(``modelopt.torch.export.unified_export_megatron``) casts each weight to the export dtype
(bf16) and then quantizes it with ``(weight / scale).to(float8_e4m3fn)``.  For per-tensor FP8
the scale is a 0-dim fp32 tensor, and PyTorch's type promotion keeps a dimensioned bf16 tensor
divided by a 0-dim fp32 tensor in bf16: every FP8 code is rounded twice (to bf16, then to FP8).
The fake quantization the MMLU gate evaluated rounds once, from fp32, so about 2-3% of the FP8
codes of a bf16 export come out one step off the weights the gate evaluated (measurements:
benchmarks/README.md, "Measurements behind the export verifier and the FP8 fix";
``pytest -s tests/test_modelopt_fixes.py`` prints the CPU ones).

The exporter does this arithmetic on CPU tensors (``module.weight.to(dtype).cpu()``) whichever
device the model is on, so the CPU tests cover the GPU path.  The fix upcasts the (exact) bf16/fp16
weight to fp32 before the division - the single rounding the fake quant uses.  CPU runs of this
project export in fp32 and were never affected.  ``tests/test_modelopt_fixes.py`` asserts the bug
is still present in the installed ModelOpt, so an upstream fix shows up as a failing test that
says to delete this module.

``nemotron_h_embedding_name`` - ModelOpt 0.47's Nemotron-H import mapping reads the embedding as
``backbone.embeddings.weight`` (the hub's Nemotron-3 checkpoints), but transformers >= 5's
``save_pretrained`` writes ``backbone.embedding.weight`` (its conversion table maps both names
on load; ModelOpt's importer knows one): ``import_mcore_gpt_from_hf`` then fails with "Key
[backbone.embeddings.weight] does not exist!".  The fix makes the importer's tensor lookup try
the other spelling of exactly that key when the first is absent.  ``tests/test_modelopt_fixes.py``
checks the installed ModelOpt still fails without it.
"""
from __future__ import annotations

FIXES = ("modelopt_fp8_export_single_rounding", "modelopt_nemotron_h_embedding_name")   # patch register names


def fp8_export_single_rounding(rec) -> None:
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
    rec.set(exporter, "to_quantized_weight", to_quantized_weight)


# key ModelOpt asks for -> the other spellings a checkpoint may use for it
TENSOR_NAME_ALIASES = {"backbone.embeddings.weight": ("backbone.embedding.weight",)}


def nemotron_h_embedding_name(rec) -> None:
    import modelopt.torch.export.plugins.megatron_importer as importer

    original = importer.get_safetensor

    def get_safetensor(pretrained_model_path, key, *args, **kwargs):
        try:
            return original(pretrained_model_path, key, *args, **kwargs)
        except ValueError:
            for alias in TENSOR_NAME_ALIASES.get(key, ()):
                try:
                    return original(pretrained_model_path, alias, *args, **kwargs)
                except ValueError:
                    continue
            raise

    get_safetensor.__wrapped__ = original
    rec.set(importer, "get_safetensor", get_safetensor)


def apply_modelopt_fixes() -> list[str]:
    """Apply every fix once through the patch register (idempotent); returns the names applied."""
    from launcher.megatron import patches

    return patches.apply_all(FIXES)
