"""launcher.megatron.modelopt_fixes: ModelOpt 0.47's FP8 export rounds twice (bf16, then FP8).

The exporter's arithmetic runs on CPU tensors on every device, so these CPU tests cover the GPU
path; the H200 measurement is in the module's docstring.
"""
from __future__ import annotations

import os

import pytest

from launcher_testing.checkpoints import write_tiny_qwen3_moe
from launcher_testing.ranks import run_on_ranks

pytestmark = pytest.mark.torch
torch = pytest.importorskip("torch")


@pytest.fixture(autouse=True)
def _leave_the_process_unpatched():
    """Tests here apply ModelOpt fixes in the pytest process; the register undoes them after each."""
    yield
    from launcher.megatron import patches

    patches.undo_all()


def _fp8_codes(t: "torch.Tensor") -> "torch.Tensor":
    return t.view(torch.uint8)


def test_fp8_export_rounds_once_from_fp32_after_the_fix():
    from modelopt.torch.export import quant_utils

    import modelopt.torch.export.unified_export_megatron as exporter
    from launcher.megatron.modelopt_fixes import apply_modelopt_fixes

    apply_modelopt_fixes()
    original = quant_utils.to_quantized_weight
    fixed = exporter.to_quantized_weight
    assert fixed.__wrapped__ is original
    w = (torch.randn(512, 512, generator=torch.Generator().manual_seed(0)) * 0.02).bfloat16()
    scale = w.float().abs().amax() / 448.0                        # 0-dim fp32, as ModelOpt exports it
    single = (w.float() / scale).to(torch.float8_e4m3fn)          # what the fake quant computes
    buggy = original(w, scale, "fp8")
    differ = (_fp8_codes(buggy) != _fp8_codes(single)).float().mean().item()
    print(f"ModelOpt's FP8 export of bf16 N(0, 0.02) weights: {differ:.2%} of codes double-rounded")
    assert differ > 0.01, ("the installed ModelOpt no longer double-rounds FP8 exports "
                           f"({differ:.4%} of codes differ): delete launcher/megatron/modelopt_fixes.py")
    assert torch.equal(_fp8_codes(fixed(w, scale, "fp8")), _fp8_codes(single))
    # everything else passes through unchanged: fp32 weights, and NVFP4 (per-block scales promote)
    w32 = w.float()
    assert torch.equal(_fp8_codes(fixed(w32, scale, "fp8")), _fp8_codes(original(w32, scale, "fp8")))
    from modelopt.torch.quantization.qtensor import NVFP4QTensor

    s2 = w.float().abs().amax() / (6 * 448.0)
    block_scale, _ = NVFP4QTensor.get_weights_scaling_factor(w, 16, s2)
    assert torch.equal(fixed(w, block_scale, "nvfp4", s2, 16), original(w, block_scale, "nvfp4", s2, 16))


def fp8_bf16_export_worker(src: str, out: str) -> dict:
    """FP8-quantize a tiny model on CPU (fp32), export it with dtype bf16 - as on a GPU - before
    and after the fix, and count the exported codes that differ from the fake-quantized weights."""
    import copy

    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_mcore_gpt_to_hf, import_mcore_gpt_from_hf

    from launcher.export.megatron_ref import linear_modules
    from launcher.export.verify_values import compare_references
    from launcher.megatron import modelopt_fixes, patches
    from launcher.megatron.dist import init_distributed, shutdown
    from launcher.megatron.forward import forward_logits
    from launcher.megatron.modelopt_fixes import apply_modelopt_fixes
    from launcher.megatron.models import build_model, resolve_dtype, unwrap_model
    from launcher.topology import ParallelDims

    dims = ParallelDims(world_size=1)
    init_distributed(dims, "cpu", timeout_s=120)
    model = build_model(src, dims, "cpu", "bfloat16")
    # ModelOpt's importer itself: the product's import_hf_weights applies every fix first, and
    # the "as is" export below must run on ModelOpt unfixed
    assert not set(patches.applied()) & set(modelopt_fixes.FIXES), patches.applied()
    import_mcore_gpt_from_hf(unwrap_model(model), src, dtype=resolve_dtype("bfloat16", "cpu"))
    assert not set(patches.applied()) & set(modelopt_fixes.FIXES), patches.applied()
    # round the weights to bf16 values (a bf16 checkpoint), so fp32 -> bf16 export casts are exact
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.bfloat16().float())
    gen = torch.Generator().manual_seed(7)
    batches = [torch.randint(0, 256, (4, 32), generator=gen) for _ in range(4)]
    mtq.quantize(unwrap_model(model), copy.deepcopy(mtq.FP8_DEFAULT_CFG),
                 lambda _m: [forward_logits(model, b) for b in batches])
    # the fake quantization's single rounding (weight_quantizer(weight)), computed directly: the
    # product's references (fake_quantized_references) are the exporter's arithmetic, fixes applied
    refs = {}
    with torch.no_grad():
        for m in linear_modules(model):
            w = m.module.weight_quantizer(m.module.weight) if m.weight_quantized else m.module.weight
            refs.update({name: (m.kind, part.clone()) for name, part in zip(m.hf_names, m.split(w.detach()))})
    assert not set(patches.applied()) & set(modelopt_fixes.FIXES), patches.applied()
    result = {}
    for label in ("modelopt_as_is", "fixed"):
        if label == "fixed":
            apply_modelopt_fixes()
        d = os.path.join(out, label)
        export_mcore_gpt_to_hf(unwrap_model(model), src, dtype=torch.bfloat16, export_dir=d)
        rows = compare_references(d, refs, "fp8")
        result[label] = {"modules": len(rows), "errors": sum("error" in r for r in rows),
                         "flips": sum(r.get("flips", 0) for r in rows),
                         "elements": sum(r.get("elements", 0) for r in rows)}
    shutdown()
    return result


@pytest.mark.slow
def test_fp8_export_in_bf16_matches_the_fake_quant_after_the_fix(tmp_path):
    src = write_tiny_qwen3_moe(str(tmp_path / "src"), num_layers=2)
    [r] = run_on_ranks("test_modelopt_fixes:fp8_bf16_export_worker", nprocs=1, timeout_s=300,
                       kwargs={"src": src, "out": str(tmp_path)})
    print(r)
    as_is, fixed = r["modelopt_as_is"], r["fixed"]
    assert as_is["modules"] == fixed["modules"] > 20, r
    assert as_is["flips"] > 0.01 * as_is["elements"] and as_is["errors"] > 0, r
    assert fixed["flips"] == 0 and fixed["errors"] == 0, r


def test_nemotron_h_embedding_saved_by_transformers_imports_after_the_fix(tmp_path):
    """transformers 5 saves Nemotron-H's embedding as backbone.embedding.weight; ModelOpt 0.47's
    importer asks for backbone.embeddings.weight (the hub's spelling)."""
    from safetensors.torch import load_file

    import modelopt.torch.export.plugins.megatron_importer as importer
    from launcher_testing.checkpoints import write_tiny_nemotron_h
    from launcher.megatron.modelopt_fixes import apply_modelopt_fixes

    path = write_tiny_nemotron_h(str(tmp_path), pattern="M*")
    saved = load_file(os.path.join(path, "model.safetensors"))
    assert "backbone.embedding.weight" in saved and "backbone.embeddings.weight" not in saved
    original = getattr(importer.get_safetensor, "__wrapped__", importer.get_safetensor)
    with pytest.raises(ValueError, match=r"Key \[backbone.embeddings.weight\] does not exist"):
        original(path, "backbone.embeddings.weight")      # still broken upstream: keep the fix
    apply_modelopt_fixes()
    got = importer.get_safetensor(path, "backbone.embeddings.weight")
    assert torch.equal(got, saved["backbone.embedding.weight"])
    with pytest.raises(ValueError, match=r"Key \[backbone.layers.9.norm.weight\] does not exist"):
        importer.get_safetensor(path, "backbone.layers.9.norm.weight")   # other keys: unchanged
