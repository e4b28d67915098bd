"""GPU probe: ModelOpt's CUDA fake-quant kernels vs the export's torch arithmetic, one 1024x1024 tensor.

    PYTHONPATH=<carried wheels>:. python3 scripts/gpu_quant_probe.py      # on the GPU machine

Counts elements that differ by more than 4 ulps (a "flip": rounded to another value) between
ModelOpt's fake quantization on CUDA (FP8: scaled_e4m3; NVFP4: the triton block kernel) of a bf16
N(0, 0.02) tensor and of its fp32 copy, and the single-rounding export arithmetic in fp32.
Measured on the H200 (2026-12-02, `bash scripts/gpu_checks.sh $OUT probe`, this version): FP8 0 flips from bf16 and from fp32 input (the kernel rounds
once, in fp32); NVFP4 702 of 1,048,576 (0.067%) from either input, each within one E2M1 step
(the triton kernel and NVFP4QTensor break rounding ties differently).
"""
import json

import torch


def flips(got: "torch.Tensor", ref: "torch.Tensor", dtype) -> dict:
    d = (got - ref).abs()
    return {"flips": int((d > 4 * torch.finfo(dtype).eps * ref.abs()).sum()), "n": d.numel(),
            "max_abs_diff": float(d.max())}


def main() -> None:
    import modelopt.torch.quantization.tensor_quant as tensor_quant
    from modelopt.torch.quantization.qtensor import NVFP4QTensor

    torch.manual_seed(0)
    w = (torch.randn(1024, 1024) * 0.02).bfloat16().cuda()
    amax = w.float().abs().amax()
    out = {}
    scale = amax / 448.0
    fp8_export = (w.float() / scale).to(torch.float8_e4m3fn).float() * scale
    out["fp8_bf16_vs_export_in_bf16"] = flips(tensor_quant.scaled_e4m3(w, amax, None, 4, 3).float(),
                                              fp8_export.bfloat16().float(), torch.bfloat16)
    out["fp8_fp32_vs_export_fp32"] = flips(tensor_quant.scaled_e4m3(w.float(), amax, None, 4, 3).float(),
                                           fp8_export, torch.float32)
    packed, block_scale, scale_2 = NVFP4QTensor.quantize(w, 16, weights_scaling_factor_2=amax / (6 * 448.0))
    nvfp4_export = packed.dequantize(dtype=torch.float32, scale=block_scale, double_scale=scale_2,
                                     block_sizes={-1: 16}).reshape(w.shape)
    out["nvfp4_bf16_vs_export_in_bf16"] = flips(
        tensor_quant.dynamic_block_quantize_op(w, 16, amax, 4, 2, 8, 4).float(),
        nvfp4_export.bfloat16().float(), torch.bfloat16)
    out["nvfp4_fp32_vs_export_fp32"] = flips(
        tensor_quant.dynamic_block_quantize_op(w.float(), 16, amax, 4, 2, 8, 4).float(), nvfp4_export,
        torch.float32)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
