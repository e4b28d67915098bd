"""GPU checks (run on the lent H200; skipped without CUDA): real ModelOpt kernels.

1. The CPU NVFP4 path (launcher.megatron.cpu_compat.nvfp4_fake_quant_cpu, ModelOpt's NVFP4QTensor
   arithmetic bit for bit: tests/test_nvfp4_cpu.py) against ModelOpt's GPU dynamic-block-quant
   kernel (triton) on the same weights: the tiny checkpoint's 2-D weights plus random bf16/fp32
   tensors. Reports, per tensor, the fraction of bit-identical elements, of elements equal up to
   arithmetic order (within 4 ulps of the dtype: the kernel multiplies q * fp8_scale * global_scale
   in another order) and of "flips" (an element rounded to another E2M1 value: a rounding tie broken
   differently), printed and written to $GPU_REPORT_DIR/nvfp4_cpu_vs_gpu.json when set. Asserts
   flips are at most 0.1% of each tensor and each within one E2M1 step. Measured on the H200
   (2026-12-02): fp32 tensors 0 flips but only 7-50% bit-identical (1-2 ulp differences); random
   bf16 12 flips in 131,072 elements.
2. The tiny Qwen3-MoE model quantized with NVFP4_DEFAULT_CFG and FP8_DEFAULT_CFG on one GPU
   (bf16, Float16Module) through the product code; every expert quantized, logits finite and
   close to the unquantized ones.

    .venv/bin/python -m pytest -m gpu tests/test_gpu_quantize.py -s
"""
from __future__ import annotations

import json
import math
import os

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]

from launcher_testing.checkpoints import write_tiny_qwen3_moe  # noqa: E402
from launcher_testing.ranks import run_on_ranks  # noqa: E402

E2M1_MAX, E4M3_MAX = 6.0, 448.0


def gpu_nvfp4(x: "torch.Tensor", amax: "torch.Tensor") -> "torch.Tensor":
    """ModelOpt's own GPU path (triton kernel or cuda_ext_mx), as TensorQuantizer calls it."""
    import modelopt.torch.quantization.tensor_quant as tensor_quant

    return tensor_quant.dynamic_block_quantize_op(x.cuda(), 16, amax.cuda(), 4, 2, 8, 4).cpu()


def compare(x: "torch.Tensor") -> dict:
    from launcher.megatron.cpu_compat import nvfp4_fake_quant_cpu

    amax = x.float().abs().amax()
    cpu = nvfp4_fake_quant_cpu(x.cpu(), 16, amax.cpu()).float()
    gpu = gpu_nvfp4(x, amax).float()
    diff = (cpu - gpu).abs()
    ulps = 4 * torch.finfo(x.dtype).eps * torch.maximum(cpu.abs(), gpu.abs())
    flips = diff > ulps
    # one E2M1 step at the largest block scale bounds a rounding-tie disagreement
    step = 2.0 * amax.item() / E2M1_MAX
    return {"shape": list(x.shape), "dtype": str(x.dtype), "max_abs_diff": diff.max().item(),
            "bit_identical_fraction": (cpu == gpu).float().mean().item(),
            "same_up_to_arithmetic_fraction": 1.0 - flips.float().mean().item(),
            "flips": int(flips.sum()), "bit_identical": bool(torch.equal(cpu, gpu)), "one_step": step}


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    return write_tiny_qwen3_moe(str(tmp_path_factory.mktemp("tiny_qwen3_moe_gpu")), num_layers=2)


def test_cpu_nvfp4_path_matches_gpu_kernel(tiny_moe):
    from safetensors.torch import load_file

    weights = {k: v for k, v in load_file(os.path.join(tiny_moe, "model.safetensors")).items()
               if v.dim() == 2 and v.shape[-1] % 16 == 0}
    gen = torch.Generator().manual_seed(0)
    extra = {"random_fp32": torch.randn(256, 512, generator=gen),
             "random_bf16": torch.randn(256, 512, generator=gen).bfloat16(),
             "random_heavy_tail_fp32": torch.randn(64, 1024, generator=gen) ** 3}
    rows = {name: compare(t) for name, t in {**weights, **extra}.items()}
    worst = max(r["max_abs_diff"] for r in rows.values())
    identical = sum(r["bit_identical"] for r in rows.values())
    report = {"tensors": len(rows), "bit_identical_tensors": identical, "worst_max_abs_diff": worst,
              "flips": sum(r["flips"] for r in rows.values()),
              "elements": sum(math.prod(r["shape"]) for r in rows.values()),
              "min_bit_identical_fraction": min(r["bit_identical_fraction"] for r in rows.values()),
              "per_tensor": rows}
    print(json.dumps({k: v for k, v in report.items() if k != "per_tensor"}, indent=1))
    if os.environ.get("GPU_REPORT_DIR"):
        os.makedirs(os.environ["GPU_REPORT_DIR"], exist_ok=True)
        with open(os.path.join(os.environ["GPU_REPORT_DIR"], "nvfp4_cpu_vs_gpu.json"), "w") as f:
            json.dump(report, f, indent=1)
    for name, r in rows.items():
        assert r["flips"] <= 1e-3 * math.prod(r["shape"]), (name, r)
        assert r["max_abs_diff"] <= r["one_step"] + 1e-6, (name, r)


def quantize_on_gpu(model, cfg_name: str, calib: list) -> str:
    """Quantize ``model`` in place with ModelOpt's ``cfg_name`` (NVFP4_DEFAULT_CFG, FP8_DEFAULT_CFG),
    calibrated on the token batches ``calib``, through the product's recipe resolution; the format."""
    import modelopt.torch.quantization as mtq

    from launcher.megatron.forward import forward_logits
    from launcher.megatron.models import unwrap_model
    from launcher.quant.recipes import resolve_quant_cfg
    from launcher.schema import RecipeConfig

    fmt = "nvfp4" if "NVFP4" in cfg_name else "fp8"
    mtq.quantize(unwrap_model(model), resolve_quant_cfg(RecipeConfig(name=cfg_name, format=fmt, modelopt_cfg=cfg_name)),
                 lambda _: [forward_logits(model, b) for b in calib])
    return fmt


def gpu_quantize_worker(hf_path: str, cfg_names: list[str]) -> dict:
    from launcher.megatron.dist import init_distributed, shutdown
    from launcher.megatron.forward import forward_logits
    from launcher.megatron.hf_io import import_hf_weights
    from launcher.megatron.models import build_model
    from launcher.quant.summary import check_summary, gather_summary
    from launcher.topology import ParallelDims

    dims = ParallelDims(world_size=1)
    init_distributed(dims, "cuda", timeout_s=300, seed=1234)
    gen = torch.Generator().manual_seed(5)
    calib = [torch.randint(0, 256, (2, 32), generator=gen) for _ in range(4)]
    tokens = torch.randint(0, 256, (2, 16), generator=gen)
    out = {}
    for name in cfg_names:
        model = build_model(hf_path, dims, "cuda", "bfloat16", "alltoall")
        import_hf_weights(model, hf_path, "bfloat16")
        reference = forward_logits(model, tokens)
        quantize_on_gpu(model, name, calib)
        logits = forward_logits(model, tokens)
        summary = gather_summary(model)
        out[name] = {"wrapper": type(model).__name__, "finite": bool(torch.isfinite(logits).all()),
                     "relative_error": float((logits - reference).norm() / reference.norm()),
                     "enabled_by_format": summary["enabled_by_format"],
                     "problems": check_summary(summary, True, True)}
    shutdown()
    return out


def test_quantize_tiny_moe_on_gpu_nvfp4_and_fp8(tiny_moe):
    result = run_on_ranks("test_gpu_quantize:gpu_quantize_worker", nprocs=1, timeout_s=600,
                          kwargs={"hf_path": tiny_moe, "cfg_names": ["NVFP4_DEFAULT_CFG", "FP8_DEFAULT_CFG"]},
                          env={"CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0")})[0]
    print(json.dumps(result, indent=1))
    for name, fmt in (("NVFP4_DEFAULT_CFG", "nvfp4"), ("FP8_DEFAULT_CFG", "fp8")):
        r = result[name]
        assert r["wrapper"] == "Float16Module"
        assert r["finite"] and r["problems"] == [], r
        assert set(r["enabled_by_format"]) == {fmt}, r
        assert r["relative_error"] < (0.6 if fmt == "nvfp4" else 0.2), r


def gpu_export_pack_worker(hf_path: str, out: str, cfg_names: list[str]) -> dict:
    """Quantize on the GPU, then export twice: ModelOpt's exporter packing on the GPU (the product,
    patch modelopt_export_pack_on_gpu) and on the host (the patch undone, every other fix kept).
    Each file's sha256 and each export's seconds."""
    import time

    from modelopt.torch.export import export_mcore_gpt_to_hf

    from launcher.megatron import patches
    from launcher.megatron.dist import init_distributed, shutdown
    from launcher.megatron.hf_io import export_hf, import_hf_weights
    from launcher.megatron.models import build_model, unwrap_model
    from launcher.rundir import file_sha256
    from launcher.topology import ParallelDims

    def digests(d: str) -> dict:
        return {n: file_sha256(os.path.join(d, n))
                for n in sorted(os.listdir(d)) if n.endswith(".safetensors") or n == "hf_quant_config.json"}

    dims = ParallelDims(world_size=1)
    init_distributed(dims, "cuda", timeout_s=300, seed=1234)
    gen = torch.Generator().manual_seed(5)
    calib = [torch.randint(0, 256, (2, 32), generator=gen) for _ in range(4)]
    result = {}
    for name in cfg_names:
        model = build_model(hf_path, dims, "cuda", "bfloat16", "alltoall")
        import_hf_weights(model, hf_path, "bfloat16")
        fmt = quantize_on_gpu(model, name, calib)
        r = {}
        t = time.perf_counter()
        export_hf(model, hf_path, os.path.join(out, fmt, "gpu"))     # applies every fix, the GPU packing too
        r["gpu_s"] = time.perf_counter() - t
        r["patch_applied_for_gpu"] = "modelopt_export_pack_on_gpu" in patches.applied()
        patches.undo("modelopt_export_pack_on_gpu")
        t = time.perf_counter()
        export_mcore_gpt_to_hf(unwrap_model(model), hf_path, dtype=torch.bfloat16,
                               export_dir=os.path.join(out, fmt, "host"))
        r["host_s"] = time.perf_counter() - t
        r["patch_applied_for_host"] = "modelopt_export_pack_on_gpu" in patches.applied()
        r["gpu"], r["host"] = digests(os.path.join(out, fmt, "gpu")), digests(os.path.join(out, fmt, "host"))
        result[fmt] = r
    shutdown()
    return result


def test_export_packed_on_the_gpu_is_byte_for_byte_the_host_packing(tiny_moe, tmp_path):
    result = run_on_ranks("test_gpu_quantize:gpu_export_pack_worker", nprocs=1, timeout_s=600,
                          kwargs={"hf_path": tiny_moe, "out": str(tmp_path),
                                  "cfg_names": ["NVFP4_DEFAULT_CFG", "FP8_DEFAULT_CFG"]},
                          env={"CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0")})[0]
    print(json.dumps({fmt: {k: v for k, v in r.items() if k not in ("gpu", "host")} for fmt, r in result.items()}))
    for fmt, r in result.items():
        assert r["patch_applied_for_gpu"] and not r["patch_applied_for_host"], (fmt, r)
        assert any(n.endswith(".safetensors") for n in r["gpu"]), (fmt, r["gpu"])
        assert r["gpu"] == r["host"], (fmt, r["gpu"], r["host"])
