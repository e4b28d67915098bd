"""Dequantize the weights of an exported (HF unified) checkpoint back to real numbers.

The layouts are ModelOpt 0.47's (``modelopt.torch.quantization.qtensor.NVFP4QTensor`` and
``export.quant_utils.to_quantized_weight``):

NVFP4
    ``weight``         uint8 ``[out, in/2]``: two E2M1 codes per byte; element ``2k`` is the
                       LOW nibble, element ``2k+1`` the HIGH nibble (``packed = q[1::2] << 4 |
                       q[0::2]``).  A code is ``sign << 3 | magnitude index`` into
                       ``E2M1_VALUES``.
    ``weight_scale``   float8_e4m3fn ``[out, in/16]``: one scale per block of 16 along ``in``.
    ``weight_scale_2`` fp32 scalar (per tensor: amax / (6 * 448)).
    value = e2m1 * (float(weight_scale) * weight_scale_2), computed in fp32 in that order (as
    ``NVFP4QTensor.dequantize`` does, so the result is bit-identical to ModelOpt's).
FP8 (per tensor)
    ``weight`` float8_e4m3fn ``[out, in]``, ``weight_scale`` fp32 scalar (amax / 448);
    value = float(weight) * weight_scale.

Only torch is needed (no ModelOpt import): this is an independent reading of the format.
"""
from __future__ import annotations

NVFP4_BLOCK = 16
# E2M1 magnitudes for codes 0..7; codes 8..15 are the negatives (code 8 is -0).
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def e2m1_table():
    import torch

    mags = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32)
    return torch.cat([mags, -mags])


def unpack_e2m1(packed):
    """uint8 ``[..., n/2]`` -> fp32 ``[..., n]`` E2M1 values (low nibble first)."""
    import torch

    if packed.dtype != torch.uint8:
        raise ValueError(f"NVFP4 packed weight must be uint8, got {packed.dtype}")
    low = (packed & 0x0F).long()
    high = (packed >> 4).long()
    codes = torch.stack([low, high], dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)
    return e2m1_table()[codes]


def pack_e2m1(codes):
    """Inverse of the nibble layout: int codes ``[..., n]`` (0..15) -> uint8 ``[..., n/2]``."""
    import torch

    codes = codes.to(torch.uint8)
    return (codes[..., 1::2] << 4) | codes[..., 0::2]


def nvfp4_block_size(weight, weight_scale) -> int:
    """The block size an exported NVFP4 pair was written with: in_features / scales per row
    (16 for NVFP4; ModelOpt's weight-only NVFP4 recipes may use 32)."""
    in_features, per_row = weight.shape[-1] * 2, weight_scale.shape[-1]
    if per_row < 1 or in_features % per_row:
        raise ValueError(f"NVFP4 weight_scale shape {list(weight_scale.shape)} does not divide weight "
                         f"{list(weight.shape)} into whole blocks")
    return in_features // per_row


def dequantize_nvfp4(weight, weight_scale, weight_scale_2, block_size: int = NVFP4_BLOCK):
    """fp32 ``[out, in]`` from an exported NVFP4 triple (see the module docstring)."""
    import torch

    if weight.dim() != 2:
        raise ValueError(f"NVFP4 weight must be 2-D [out, in/2], got shape {list(weight.shape)}")
    out_features, in_features = weight.shape[0], weight.shape[1] * 2
    if in_features % block_size:
        raise ValueError(f"in_features {in_features} is not a multiple of the block size {block_size}")
    expected = [out_features, in_features // block_size]
    if list(weight_scale.shape) != expected:
        raise ValueError(
            f"NVFP4 weight_scale shape {list(weight_scale.shape)} != {expected} for weight "
            f"{list(weight.shape)} (block {block_size})")
    if weight_scale_2.numel() != 1:
        raise ValueError(f"NVFP4 weight_scale_2 must be a scalar, got shape {list(weight_scale_2.shape)}")
    values = unpack_e2m1(weight).view(out_features, -1, block_size)
    block_scale = weight_scale.to(torch.float32) * weight_scale_2.to(torch.float32).reshape(())
    return (values * block_scale.unsqueeze(-1)).reshape(out_features, in_features)


def dequantize_fp8(weight, weight_scale):
    """fp32 ``[out, in]`` from an FP8 weight and its per-tensor (or per-row) fp32 scale."""
    import torch

    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"FP8 weight must be float8_e4m3fn, got {weight.dtype}")
    scale = weight_scale.to(torch.float32)
    if scale.numel() == 1:
        scale = scale.reshape(())
    elif scale.dim() == 1 and scale.shape[0] == weight.shape[0]:
        scale = scale.unsqueeze(-1)
    elif list(scale.shape) != [weight.shape[0], 1]:
        raise ValueError(
            f"FP8 weight_scale shape {list(weight_scale.shape)} fits neither per-tensor nor "
            f"per-row scaling of weight {list(weight.shape)}")
    return weight.to(torch.float32) * scale


def dequantize_module(fmt: str, tensors: dict):
    """Dequantize one module's exported tensors (keys ``weight``, ``weight_scale``, ...)."""
    if fmt == "nvfp4":
        return dequantize_nvfp4(tensors["weight"], tensors["weight_scale"], tensors["weight_scale_2"],
                                nvfp4_block_size(tensors["weight"], tensors["weight_scale"]))
    if fmt == "fp8":
        return dequantize_fp8(tensors["weight"], tensors["weight_scale"])
    raise ValueError(f"cannot dequantize format {fmt!r}; supported: nvfp4, fp8")


# Largest gap from an E2M1 magnitude (codes 0..7) to a neighbouring representable magnitude.
_E2M1_GAP = (0.5, 0.5, 0.5, 0.5, 1.0, 1.0, 2.0, 2.0)


def quantization_step(fmt: str, tensors: dict):
    """fp32 ``[out, in]``: per element, the distance to the next representable value of the
    exported format (what one rounding decision taken the other way changes it by)."""
    import torch

    if fmt == "nvfp4":
        w, scale, scale_2 = tensors["weight"], tensors["weight_scale"], tensors["weight_scale_2"]
        codes = torch.stack([w & 0x07, (w >> 4) & 0x07], dim=-1).reshape(w.shape[0], -1).long()
        gaps = torch.tensor(_E2M1_GAP)[codes].view(w.shape[0], -1, nvfp4_block_size(w, scale))
        block = scale.to(torch.float32) * scale_2.to(torch.float32).reshape(())
        return (gaps * block.unsqueeze(-1)).reshape(w.shape[0], -1)
    if fmt == "fp8":
        v = tensors["weight"].to(torch.float32).abs()
        exponent = torch.floor(torch.log2(v.clamp_min(2.0 ** -6)))
        ulp = torch.pow(2.0, exponent - 3)           # e4m3: 3 mantissa bits; subnormals 2^-9
        scale = tensors["weight_scale"].to(torch.float32)
        scale = scale.reshape(()) if scale.numel() == 1 else scale.reshape(-1, 1)
        return 2.0 * ulp * scale                      # the gap above may be the next binade's
    raise ValueError(f"no quantization step for format {fmt!r}; supported: nvfp4, fp8")
