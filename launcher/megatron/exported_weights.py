"""The weight an HF export writes for a quantized linear, dequantized: what the gate evaluates.

ModelOpt's Megatron exporter (``modelopt.torch.export.unified_export_megatron``) writes, for each
quantized linear, codes and scales computed by its own torch arithmetic:

    weight_scale   = get_weight_scaling_factor(module)        (from the module's weight and quantizer)
    weight_scale_2 = get_weight_scaling_factor_2(module)
    codes          = to_quantized_weight(module.weight.to(dtype), weight_scale, fmt, weight_scale_2, block)

The fake quantization the model computes with during calibration (``weight_quantizer(weight)``)
is the same rule but, on a GPU, another implementation (ModelOpt's triton kernel), and it breaks
rounding ties differently: on the H200 about 1% of a tiny Nemotron-H's NVFP4 ``in_proj``
elements came out one step apart.  A gate that evaluated ``weight_quantizer(weight)`` would
pass a model that differs from the checkpoint we ship.  ``exported_weight`` runs the
exporter's own functions (the module attribute, so ``launcher.megatron.modelopt_fixes`` applies)
on the module and dequantizes the codes with ModelOpt's dequantization; the gate folds that
(``launcher.megatron.fold``) and the export verifier compares the exported files with it
(``launcher.export.megatron_ref``), so the verifier's 0 flips mean "the gate evaluated these
bytes".  On CPU the two implementations agree bit for bit (the CPU NVFP4 shim is
``NVFP4QTensor``), so CPU results are unchanged.

Formats: NVFP4 (weight-only too) and per-tensor FP8, the formats the pipeline carries
(``launcher.formats``); any other enabled weight quantizer falls back to ``weight_quantizer(weight)``
and is reported by ``exported_format`` as None.
"""
from __future__ import annotations

NVFP4_FORMATS = ("nvfp4", "nvfp4_awq", "w4a16_nvfp4")
FP8_FORMATS = ("fp8",)


def exported_format(module) -> str | None:
    """ModelOpt's quantization format name of ``module`` when ``exported_weight`` covers it."""
    from modelopt.torch.export.quant_utils import get_quantization_format

    fmt = get_quantization_format(module)
    return fmt if fmt in NVFP4_FORMATS + FP8_FORMATS else None


def exported_weight(module, dtype=None):
    """``module.weight`` as the export stores it (codes and scales), dequantized, in the weight's
    own dtype; None when the module's format is not one the exporter packs (see module doc).

    ``dtype``: the export's dtype (the exporter casts the weight to it before packing); default
    the weight's own.
    """
    import torch
    import modelopt.torch.export.unified_export_megatron as exporter
    from modelopt.torch.export.quant_utils import (
        get_weight_block_size, get_weight_scaling_factor, get_weight_scaling_factor_2)

    from launcher.megatron.modelopt_fixes import apply_modelopt_fixes

    fmt = exported_format(module)
    if fmt is None:
        return None
    apply_modelopt_fixes()
    weight = module.weight
    with torch.no_grad():
        scale = get_weight_scaling_factor(module)
        scale_2 = get_weight_scaling_factor_2(module)
        block = get_weight_block_size(module)
        w = weight.detach().to(dtype or weight.dtype)
        codes = exporter.to_quantized_weight(w, scale, fmt, scale_2, block)
        if fmt in FP8_FORMATS:
            value = codes.to(torch.float32) * scale.to(codes.device, torch.float32)
        else:
            value = _nvfp4_value(codes, scale.to(codes.device), scale_2.to(codes.device), block, w.shape)
    return value.to(weight.dtype).reshape(weight.shape)


def gated_weight(module, dtype=None):
    """The weight the MMLU gate evaluates for a quantized linear: ``exported_weight`` where the
    exporter packs the module's format, else ``weight_quantizer(weight)`` (the fold and the
    export verifier's references both take it from here)."""
    value = exported_weight(module, dtype)
    return module.weight_quantizer(module.weight) if value is None else value


def _nvfp4_value(codes, scale, scale_2, block: int, shape):
    import torch
    from modelopt.torch.quantization.qtensor import NVFP4QTensor

    packed = NVFP4QTensor(torch.Size(shape), torch.float32, codes)
    return packed.dequantize(dtype=torch.float32, scale=scale, double_scale=scale_2, block_sizes={-1: block})
