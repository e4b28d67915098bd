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
    out.update(export_arithmetic_gpu_vs_cpu())
    print(json.dumps(out, indent=1))
    import os
    if os.environ.get("GPU_REPORT_DIR"):
        with open(os.path.join(os.environ["GPU_REPORT_DIR"], "probe.json"), "w") as f:
            json.dump(out, f, indent=1)


def export_arithmetic_gpu_vs_cpu() -> dict:
    """The exporter's packing (NVFP4QTensor / FP8 division, as ``to_quantized_weight`` does it) of
    the same bf16 tensors on the GPU and on the CPU, where ModelOpt's exporter runs it: are the
    codes and scales the same bytes?  (launcher.megatron.exported_weights computes the gate's
    folded weights on the model's device.)"""
    from modelopt.torch.quantization.qtensor import NVFP4QTensor

    out = {}
    g = torch.Generator().manual_seed(1)
    for shape in ((1024, 1024), (2688, 1856), (512, 4096)):
        w = (torch.randn(*shape, generator=g) * 0.02).bfloat16()
        amax = w.float().abs().amax()
        res = {}
        for dev in ("cpu", "cuda"):
            x = w.to(dev)
            s2 = (amax / (6 * 448.0)).to(dev)
            sc, _ = NVFP4QTensor.get_weights_scaling_factor(x, 16, s2)
            q, _, _ = NVFP4QTensor.quantize(x, 16, sc, s2)
            fp8_scale = (amax / 448.0).to(dev)
            res[dev] = (q._quantized_data.cpu(), sc.cpu().view(torch.uint8),
                        (x.float() / fp8_scale).to(torch.float8_e4m3fn).cpu().view(torch.uint8))
        key = "x".join(map(str, shape))
        out[f"export_arith_nvfp4_codes_{key}_gpu_vs_cpu_differ"] = int((res["cpu"][0] != res["cuda"][0]).sum())
        out[f"export_arith_nvfp4_scales_{key}_gpu_vs_cpu_differ"] = int((res["cpu"][1] != res["cuda"][1]).sum())
        out[f"export_arith_fp8_codes_{key}_gpu_vs_cpu_differ"] = int((res["cpu"][2] != res["cuda"][2]).sum())
    return out


if __name__ == "__main__":
    main()
