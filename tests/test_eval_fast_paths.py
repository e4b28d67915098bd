"""The gate's evaluation fast paths give the reference path's logits: folded weight quantizers,
grouped experts, SDPA attention - real megatron-core + ModelOpt on 2 gloo ranks (EP2, CPU).

Per recipe (none, NVFP4_DEFAULT_CFG, FP8_DEFAULT_CFG) the tiny random Qwen3-MoE (4 layers, 8
experts top-2, 4 local experts per rank) is quantized in place with real calibration, then:
logits of the per-expert loop with quantizers running every forward (the reference) ==
after ``fold_weight_quantizers`` == after ``enable_grouped_experts`` (bit for bit on CPU), also
for a 3-token batch that leaves experts without tokens; folded weights == ModelOpt's own
``mtq.fold_weight`` (fp32 here, where its fp32 copy changes nothing); experts whose input
quantizers differ (amax made per-expert) take the per-expert quantizer path and still match.
SDPA core attention (``eval_kernels``) changes logits by < 1e-5 and no prediction.
"""
from __future__ import annotations

import os

import pytest

from launcher_testing.ranks import run_on_ranks

RECIPES = ("none", "NVFP4_DEFAULT_CFG", "FP8_DEFAULT_CFG")

pytestmark = pytest.mark.torch   # imports torch, Megatron or ModelOpt (in-process or in its ranks)


def fast_paths_worker(hf_path: str) -> dict:
    import torch
    import modelopt.torch.quantization as mtq

    from launcher.megatron.dist import init_distributed, shutdown
    from launcher.megatron.fold import fold_weight_quantizers
    from launcher.megatron.forward import forward_logits
    from launcher.megatron.grouped_experts import disable_grouped_experts, enable_grouped_experts
    from launcher.megatron.hf_io import import_hf_weights
    from launcher.megatron.models import build_model, unwrap_model
    from launcher.topology import ParallelDims

    dims = ParallelDims(world_size=2, ep=2)
    init_distributed(dims, "cpu", timeout_s=120, seed=1234)
    g = torch.Generator().manual_seed(5)
    calib = [torch.randint(0, 256, (4, 24), generator=g) for _ in range(3)]
    cases = [(torch.randint(0, 256, (4, 30), generator=g), torch.tensor([29, 3, 17, 11])),
             (torch.randint(0, 256, (1, 3), generator=g), torch.tensor([2]))]   # 3 tokens: idle experts

    def built(recipe):
        model = build_model(hf_path, dims, "cpu", "bfloat16", "alltoall")
        import_hf_weights(model, hf_path, "float32")
        if recipe != "none":
            mtq.quantize(unwrap_model(model), getattr(mtq, recipe),
                         lambda _m: [forward_logits(model, b) for b in calib])
        return model

    def logits(model):
        return [forward_logits(model, t, positions=p) for t, p in cases]

    def same(a, b):
        return all(torch.equal(x, y) for x, y in zip(a, b))

    out = {}
    for recipe in RECIPES:
        model = built(recipe)
        ref = logits(model)
        folded = fold_weight_quantizers(model)
        after_fold = logits(model)
        grouped = enable_grouped_experts(model)
        after_group = logits(model)
        disable_grouped_experts(model)
        after_disable = logits(model)
        r = {"folded": folded["folded"], "as_exported": folded["as_exported"], "grouped": len(grouped["grouped"]),
             "kept": grouped["kept"],
             "input_quantization": sorted({v for q in grouped["input_quantization"].values() for v in q.values()}),
             "fold_equal": same(ref, after_fold),
             "fold_max_abs_diff": max(float((x - y).abs().max()) for x, y in zip(ref, after_fold)),
             "fold_same_argmax": all(torch.equal(x.argmax(-1), y.argmax(-1)) for x, y in zip(ref, after_fold)),
             "group_equal": same(after_fold, after_group), "disable_equal": same(after_fold, after_disable)}
        if recipe != "none":
            # ModelOpt's own fold on an identically calibrated model stores the same weights
            other = built(recipe)
            mtq.fold_weight(unwrap_model(other))
            mine = dict(unwrap_model(model).named_parameters())
            r["same_as_mtq_fold_weight"] = all(torch.equal(mine[n], p) for n, p in unwrap_model(other).named_parameters())
            # per-expert input amax (as after a calibration without the expert sync): quantizer loop
            disable_grouped_experts(model)
            for _, experts in [(n, m) for n, m in unwrap_model(model).named_modules() if hasattr(m, "local_experts")]:
                for j, e in enumerate(experts.local_experts):
                    for lin in (e.linear_fc1, e.linear_fc2):
                        lin.input_quantizer.amax = lin.input_quantizer.amax * (1 + 0.25 * j)
            ref_each = logits(model)
            each = enable_grouped_experts(model)
            r["each_plan"] = sorted({v for q in each["input_quantization"].values() for v in q.values()})
            r["each_equal"] = same(ref_each, logits(model))
            r["each_differs_from_shared"] = not same(ref_each, ref)
        out[recipe] = r
        del model
    # SDPA core attention vs the local spec's unfused attention, same weights
    local, sdpa = built("none"), build_model(hf_path, dims, "cpu", "bfloat16", "alltoall", eval_kernels=True)
    import_hf_weights(sdpa, hf_path, "float32")
    a, b = logits(local), logits(sdpa)
    out["sdpa"] = {"max_abs_diff": max(float((x - y).abs().max()) for x, y in zip(a, b)),
                   "same_argmax": all(torch.equal(x.argmax(-1), y.argmax(-1)) for x, y in zip(a, b)),
                   "core_attention": type(unwrap_model(sdpa).decoder.layers[0].self_attention.core_attention).__name__}
    shutdown()
    return out


@pytest.mark.slow
def test_fold_grouped_experts_and_sdpa_match_reference(random_tiny_moe):
    results = run_on_ranks("test_eval_fast_paths:fast_paths_worker", nprocs=2, timeout_s=400,
                           kwargs={"hf_path": random_tiny_moe})
    for rank, res in enumerate(results):
        for recipe in RECIPES:
            r = res[recipe]
            assert r["grouped"] == 4 and r["kept"] == {}, (rank, recipe, r)
            assert r["group_equal"] and r["disable_equal"], (rank, recipe, r)
            if recipe == "FP8_DEFAULT_CFG":
                # the fold is the exporter's code * scale; the fake quant divides by 448/amax: ulps apart
                assert r["fold_max_abs_diff"] < 1e-5 and r["fold_same_argmax"], (rank, recipe, r)
            else:
                assert r["fold_equal"], (rank, recipe, r)   # NVFP4: the CPU shim is the exporter's NVFP4QTensor
            if recipe == "none":
                assert r["folded"] == 0 and r["input_quantization"] == ["none"]
            else:
                # every linear of this rank's stage except router and output layer: 4 layers x
                # (qkv, proj, 4 local experts x 2) = 40 weight quantizers
                assert r["folded"] == r["as_exported"] == 40, (rank, recipe, r)
                assert r["input_quantization"] == ["shared"], (rank, recipe, r)
                assert r["same_as_mtq_fold_weight"] is (recipe != "FP8_DEFAULT_CFG"), (rank, recipe)
                assert r["each_plan"] == ["each"] and r["each_equal"], (rank, recipe, r)
                assert r["each_differs_from_shared"], "the per-expert amax must matter, or the test proves nothing"
        s = res["sdpa"]
        assert s["core_attention"] == "SdpaCoreAttention"
        assert 0 < s["max_abs_diff"] < 1e-5 and s["same_argmax"], s


def test_identity_chunk_sort_is_skipped_and_others_unchanged():
    pytest.importorskip("torch")
    import torch
    import megatron.core.transformer.moe.token_dispatcher as td
    from megatron.core.transformer.moe.moe_utils import sort_chunks_by_idxs as megatron_sort

    from launcher.megatron.grouped_experts import skip_identity_chunk_sort

    from launcher.megatron import patches

    skip_identity_chunk_sort()
    try:
        _check_identity_sort(td, megatron_sort)
    finally:   # the pytest process is left unpatched
        assert patches.undo("moe_skip_identity_chunk_sort")
    assert td.sort_chunks_by_idxs is megatron_sort


def _check_identity_sort(td, megatron_sort):
    import torch

    from launcher.megatron.grouped_experts import skip_identity_chunk_sort

    assert td.sort_chunks_by_idxs is not megatron_sort and not skip_identity_chunk_sort()   # once
    x, probs = torch.randn(10, 3), torch.rand(10)
    sizes = torch.tensor([3, 2, 4, 1])
    identity = torch.arange(4)
    out, p = td.sort_chunks_by_idxs(x, sizes, identity, probs=probs)
    ref, ref_p = megatron_sort(x, sizes, identity, probs=probs)
    assert out is x and p is probs and torch.equal(out, ref) and torch.equal(p, ref_p)   # no copy
    order = torch.tensor([0, 2, 1, 3])                    # EP2 x 2 local experts: a real reorder
    out, p = td.sort_chunks_by_idxs(x, sizes, order, probs=probs)
    ref, ref_p = megatron_sort(x, sizes, order, probs=probs)
    assert torch.equal(out, ref) and torch.equal(p, ref_p) and not torch.equal(out, x)
