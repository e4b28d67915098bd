"""launcher.megatron.modelopt_fixes: ModelOpt 0.47's FP8 export rounds twice (bf16, then FP8).

The exporter's arithmetic runs on CPU tensors on every device, so these CPU tests cover the GPU
path; the H200 measurement is in the module's docstring.
"""
from __future__ import annotations

import json
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


# ------------------------------------------------------------------ NVFP4: the same codes, faster
def _every_rounding_case(dtype) -> "torch.Tensor":
    """Each E2M1 bound exactly and its float neighbours, both signs, +-0, +-inf, NaN, and normal
    values at three scales (2**16 of each), in ``dtype``."""
    from launcher.megatron.modelopt_fixes import E2M1_BOUNDS

    b = torch.tensor(E2M1_BOUNDS, dtype=dtype)
    up, down = torch.nextafter(b, torch.full_like(b, 10)), torch.nextafter(b, torch.zeros_like(b))
    edges = torch.cat([b, up, down, torch.tensor([0.0, -0.0, 6.0, 7.5, float("inf"), float("-inf"), float("nan")],
                                                 dtype=dtype)])
    gen = torch.Generator().manual_seed(3)
    normal = torch.cat([torch.randn(1 << 16, generator=gen) * s for s in (0.5, 2.0, 8.0)]).to(dtype)
    return torch.cat([edges, -edges, normal])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fast_e2m1_cast_gives_modelopts_codes(dtype):
    from modelopt.torch.quantization.qtensor import NVFP4QTensor

    from launcher.megatron.modelopt_fixes import E2M1_BOUNDS, cast_fp4

    assert NVFP4QTensor.get_e2m1_bounds(torch.device("cpu")).tolist() == list(E2M1_BOUNDS)
    x = _every_rounding_case(dtype)
    theirs = NVFP4QTensor._cast_fp4(x.clone())
    ours = cast_fp4(x.clone())
    assert ours.dtype == theirs.dtype == torch.uint8
    assert torch.equal(ours, theirs), (x[ours != theirs], ours[ours != theirs], theirs[ours != theirs])
    assert sorted(set(ours.tolist())) == list(range(16))          # every code, both signs, occurs


def test_nvfp4_quantize_packs_the_same_bytes_with_the_fix_and_undoes_cleanly():
    from modelopt.torch.quantization.qtensor import NVFP4QTensor

    from launcher.megatron import patches

    w = (torch.randn(256, 512, generator=torch.Generator().manual_seed(5)) * 0.02).bfloat16()
    original = NVFP4QTensor.__dict__["_cast_fp4"]
    before = NVFP4QTensor.quantize(w, 16)
    assert patches.apply("modelopt_nvfp4_fast_cast")
    assert NVFP4QTensor.__dict__["_cast_fp4"] is not original
    after = NVFP4QTensor.quantize(w, 16)
    assert torch.equal(after[0]._quantized_data, before[0]._quantized_data)
    assert torch.equal(after[1].view(torch.uint8), before[1].view(torch.uint8)) and torch.equal(after[2], before[2])
    patches.undo("modelopt_nvfp4_fast_cast")
    assert NVFP4QTensor.__dict__["_cast_fp4"] is original


def test_export_pack_on_gpu_routes_only_host_weights_to_the_device_and_returns_host_codes():
    """``pack_on``'s routing, with the meta device standing in for CUDA: a plain host tensor is
    packed on the device and its codes come back to the host; a weight already on a device (the
    gate's fold) and a Parameter (ModelOpt's QTensorWrapper is one) reach ModelOpt as they are.
    The bytes on a real GPU: tests/test_gpu_quantize.py."""
    from launcher.megatron.modelopt_fixes import pack_on

    seen = []

    def original(weight, scale, fmt, *rest):
        seen.append((weight.device.type, type(weight).__name__, fmt, rest))
        return torch.zeros(2, dtype=torch.uint8, device=weight.device) if weight.device.type == "cpu" \
            else torch.empty(2, dtype=torch.uint8, device=weight.device)

    meta = torch.device("meta")
    wrapped = pack_on(meta, original)
    assert wrapped.__wrapped__ is original
    with pytest.raises(NotImplementedError, match="meta"):      # host codes are asked for: .cpu() of meta
        wrapped(torch.ones(4), None, "nvfp4", "scale_2", 16)
    assert seen.pop() == ("meta", "Tensor", "nvfp4", ("scale_2", 16))
    assert wrapped(torch.ones(4, device=meta), None, "fp8").device == meta
    assert seen.pop() == ("meta", "Tensor", "fp8", ())
    out = wrapped(torch.nn.Parameter(torch.ones(4)), None, "fp8")
    assert seen.pop() == ("cpu", "Parameter", "fp8", ()) and out.device.type == "cpu"


def test_export_pack_on_gpu_is_not_applied_on_a_rank_without_cuda():
    from launcher.megatron import patches
    import modelopt.torch.export.unified_export_megatron as exporter

    assert not torch.cuda.is_available()
    before = exporter.to_quantized_weight
    assert patches.apply("modelopt_export_pack_on_gpu") is False
    assert "modelopt_export_pack_on_gpu" not in patches.applied()
    assert exporter.to_quantized_weight is before


def nvfp4_export_bytes_worker(src: str, out: str) -> dict:
    """NVFP4-quantize a tiny model on CPU, export it with ModelOpt's own E2M1 cast and again with the
    fast one (every other fix applied to both): each file's sha256."""
    import copy
    import hashlib

    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_mcore_gpt_to_hf

    from launcher.megatron import patches
    from launcher.megatron.dist import init_distributed, shutdown
    from launcher.megatron.forward import forward_logits
    from launcher.megatron.hf_io import import_hf_weights
    from launcher.megatron.models import build_model, unwrap_model
    from launcher.topology import ParallelDims

    dims = ParallelDims(world_size=1)
    init_distributed(dims, "cpu", timeout_s=120)
    model = build_model(src, dims, "cpu", "float32")
    import_hf_weights(model, src, "float32")
    patches.undo("modelopt_nvfp4_fast_cast")          # quantize and the first export: ModelOpt's own cast
    gen = torch.Generator().manual_seed(7)
    batches = [torch.randint(0, 256, (4, 32), generator=gen) for _ in range(4)]
    mtq.quantize(unwrap_model(model), copy.deepcopy(mtq.NVFP4_DEFAULT_CFG),
                 lambda _m: [forward_logits(model, b) for b in batches])
    digests = {}
    for label in ("modelopt_cast", "fast_cast"):
        if label == "fast_cast":
            assert patches.apply("modelopt_nvfp4_fast_cast")
        assert ("modelopt_nvfp4_fast_cast" in patches.applied()) == (label == "fast_cast")
        d = os.path.join(out, label)
        export_mcore_gpt_to_hf(unwrap_model(model), src, dtype=torch.float32, export_dir=d)
        digests[label] = {name: hashlib.sha256(open(os.path.join(d, name), "rb").read()).hexdigest()
                          for name in sorted(os.listdir(d))}
    from safetensors import safe_open

    packed = 0   # NVFP4 weights as written: uint8 E2M1 code pairs (every one went through _cast_fp4)
    for name in os.listdir(d):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(d, name), "pt") as f:
                packed += sum(f.get_slice(k).get_dtype() == "U8" for k in f.keys() if k.endswith(".weight"))
    with open(os.path.join(d, "hf_quant_config.json")) as f:
        algo = json.load(f)["quantization"]["quant_algo"]
    shutdown()
    return {**digests, "packed_weights": packed, "quant_algo": algo}


@pytest.mark.slow
def test_nvfp4_export_files_are_byte_for_byte_modelopts(tmp_path):
    src = write_tiny_qwen3_moe(str(tmp_path / "src"), num_layers=2)
    [r] = run_on_ranks("test_modelopt_fixes:nvfp4_export_bytes_worker", nprocs=1, timeout_s=400,
                       kwargs={"src": src, "out": str(tmp_path)})
    theirs, ours = r["modelopt_cast"], r["fast_cast"]
    assert r["quant_algo"] == "NVFP4" and r["packed_weights"] > 20, r
    assert any(n.endswith(".safetensors") for n in theirs) and "hf_quant_config.json" in theirs, theirs
    assert ours == theirs


class _LinearWithExtraState(torch.nn.Module):
    """A linear with TransformerEngine's ``_extra_state`` protocol (TE's modules keep their FP8
    metadata there) and no fused norm: what the TE spec's MoE expert fc1 is."""

    def __init__(self, out_features: int, in_features: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(out_features, in_features))
        self.extra_loaded = []

    def get_extra_state(self):
        return torch.tensor([7])

    def set_extra_state(self, state):
        self.extra_loaded.append(state)


class _Importer:
    """What ModelOpt's ``_gated_mlp_merging`` reads from its importer: the dtype and the HF tensors."""

    dtype = torch.float32

    def __init__(self, tensors: dict):
        self.tensors = tensors

    def _get_safetensor(self, key, parallel_config=None):
        return self.tensors[key]


def test_te_expert_fc1_with_extra_state_imports_after_the_fix():
    """ModelOpt's own merge (gate and up stacked into fc1) on a module with extra state: the strict
    load fails as on the H100 without the fix; with it the weight is the merged one and the module's
    own extra state is given back; a module without extra state is untouched by the fix."""
    from modelopt.torch.export.plugins.megatron_importer import GPTModelImporter

    from launcher.megatron import patches

    gate, up = torch.randn(3, 4), torch.randn(3, 4)
    importer = _Importer({"e.gate_proj.weight": gate, "e.up_proj.weight": up})
    original = GPTModelImporter.__dict__["_gated_mlp_merging"]
    with pytest.raises(RuntimeError, match='Missing key\\(s\\) in state_dict: "_extra_state"'):
        GPTModelImporter._gated_mlp_merging(importer, _LinearWithExtraState(6, 4), "e.")
    assert patches.apply("modelopt_te_gated_mlp_extra_state")
    module = _LinearWithExtraState(6, 4)
    GPTModelImporter._gated_mlp_merging(importer, module, "e.")
    assert torch.equal(module.weight.data, torch.cat((gate, up)))
    assert [s.tolist() for s in module.extra_loaded] == [[7]]
    assert "load_state_dict" not in vars(module)          # the per-call wrapper is gone
    plain = torch.nn.Linear(4, 6, bias=False)
    GPTModelImporter._gated_mlp_merging(importer, plain, "e.")
    assert torch.equal(plain.weight.data, torch.cat((gate, up)))
    patches.undo("modelopt_te_gated_mlp_extra_state")
    assert GPTModelImporter.__dict__["_gated_mlp_merging"] is original
