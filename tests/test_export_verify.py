"""Export verification on real ModelOpt exports of a tiny random Qwen3-MoE (2 layers, 8 experts).

One session fixture runs a single gloo rank (subprocess, ~30 s): import the HF weights into a
Megatron GPTModel at EP1, export unquantized (recipe none), quantize with NVFP4_DEFAULT_CFG,
export again, and compare the dequantized export with the model's fake-quantized weights.
The tests then verify those exports and copies of them corrupted in one precise way each.
"""
from __future__ import annotations

import json
import os
import shutil

import pytest

from launcher_testing.checkpoints import write_tiny_qwen3_moe
from launcher_testing.ranks import run_on_ranks

NUM_LAYERS, NUM_EXPERTS = 2, 8

pytestmark = pytest.mark.torch   # imports torch, Megatron or ModelOpt (in-process or in its ranks)


# ---------------------------------------------------------------- the rank's code (subprocess)

def make_exports_worker(src: str, out: str) -> dict:
    import copy

    import modelopt.torch.quantization as mtq
    import torch

    from launcher.export.megatron_ref import (
        fake_quantized_references, linear_modules, quantized_hf_modules, select_samples)
    from launcher.export.verify_values import compare_references
    from launcher.megatron.dist import init_distributed, shutdown
    from launcher.megatron.forward import forward_logits
    from launcher.megatron.hf_io import export_hf, import_hf_weights
    from launcher.megatron.models import build_model, unwrap_model
    from launcher.topology import ParallelDims

    dims = ParallelDims(world_size=1)
    init_distributed(dims, "cpu", timeout_s=120)
    model = build_model(src, dims, "cpu", "bfloat16")
    import_hf_weights(model, src, "bfloat16")
    export_hf(model, src, os.path.join(out, "none"), "bfloat16")
    gen = torch.Generator().manual_seed(7)
    batches = [torch.randint(0, 256, (4, 32), generator=gen) for _ in range(4)]
    mtq.quantize(unwrap_model(model), copy.deepcopy(mtq.NVFP4_DEFAULT_CFG),
                 lambda _m: [forward_logits(model, b) for b in batches])
    export_hf(model, src, os.path.join(out, "nvfp4"), "bfloat16")
    linears = linear_modules(model)
    every = fake_quantized_references(linears)
    sampled = select_samples(linears, 4, NUM_LAYERS, NUM_EXPERTS)
    result = {
        "all": compare_references(os.path.join(out, "nvfp4"), every, "nvfp4"),
        "sampled": [n for m in sampled for n in m.hf_names],
        "quantized_modules": sorted(quantized_hf_modules(model)),
    }
    # recipe nvfp4_mlp_weight_only (ModelOpt's general/ptq/nvfp4_mlp_weight_only): weight-only
    # NVFP4 in blocks of 32, experts only
    import yaml

    from launcher.paths import REPO_ROOT
    from launcher.schema import RecipeConfig
    from launcher.quant.recipes import resolve_quant_cfg

    with open(os.path.join(REPO_ROOT, "recipes", "nvfp4_mlp_weight_only.yaml")) as f:
        cfg = resolve_quant_cfg(RecipeConfig(**yaml.safe_load(f)))
    model = build_model(src, dims, "cpu", "bfloat16")
    import_hf_weights(model, src, "bfloat16")
    mtq.quantize(unwrap_model(model), cfg, lambda _m: [forward_logits(model, b) for b in batches])
    export_hf(model, src, os.path.join(out, "nvfp4_w32"), "bfloat16")
    result["w32_all"] = compare_references(os.path.join(out, "nvfp4_w32"),
                                           fake_quantized_references(linear_modules(model)), "nvfp4")
    result["w32_quantized_modules"] = sorted(quantized_hf_modules(model))
    shutdown()
    return result


# ---------------------------------------------------------------- fixtures and helpers

@pytest.fixture(scope="session")
def exports(tmp_path_factory):
    root = tmp_path_factory.mktemp("export_verify")
    src = write_tiny_qwen3_moe(str(root / "src"), num_layers=NUM_LAYERS)
    [result] = run_on_ranks("test_export_verify:make_exports_worker", nprocs=1,
                            kwargs={"src": src, "out": str(root)}, timeout_s=300)
    return {"src": src, "nvfp4": str(root / "nvfp4"), "none": str(root / "none"),
            "nvfp4_w32": str(root / "nvfp4_w32"), **result}


def _copy(exports, tmp_path, which="nvfp4") -> str:
    dst = str(tmp_path / which)
    shutil.copytree(exports[which], dst)
    return dst


def _index(d):
    with open(os.path.join(d, "model.safetensors.index.json")) as f:
        return json.load(f)


def _rewrite(d: str, edit) -> None:
    """Load the shard holding each tensor ``edit`` touches, let ``edit(name -> tensor)`` change it, save."""
    from safetensors.torch import load_file, save_file

    index = _index(d)
    for shard in sorted(set(index["weight_map"].values())):
        path = os.path.join(d, shard)
        tensors = load_file(path)
        before = set(tensors)
        edit(tensors)
        save_file(tensors, path, metadata={"format": "pt"})
        for gone in before - set(tensors):
            del index["weight_map"][gone]
    index["metadata"]["total_size"] = sum(
        t.numel() * t.element_size() for shard in set(index["weight_map"].values())
        for t in load_file(os.path.join(d, shard)).values())
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f)


def _verify(d, fmt="nvfp4", exports=None, **kw):
    from launcher.export.verify import verify_export

    return verify_export(d, fmt, num_layers=NUM_LAYERS, num_experts=NUM_EXPERTS,
                         source_dir=exports["src"] if exports else None, **kw)


# ---------------------------------------------------------------- the exports verify

def test_nvfp4_export_verifies(exports):
    report = _verify(exports["nvfp4"], exports=exports, quantized_modules=set(exports["quantized_modules"]),
                     quantize_experts=True)
    assert report["errors"] == [] and report["ok"] is True
    per_layer = 4 + NUM_EXPERTS * 3          # q k v o + gate/up/down of each expert
    assert report["checks"]["modules"] == {"quantized": NUM_LAYERS * per_layer, "excluded": 4, "high_precision": 9}
    assert sorted(report["checks"]["quant_config"]["exclude_modules"]) == [
        "lm_head", "model.embed_tokens", "model.layers.0.mlp.gate", "model.layers.1.mlp.gate"]
    assert report["checks"]["names_vs_source"] == {"source_tensors": 69, "missing": 0, "extra": 0}
    assert report["checks"]["layers"] == {"num_layers": 2, "num_experts": 8, "moe_layers": 2}
    by_kind = report["checks"]["dequant_vs_source"]["by_kind"]
    assert set(by_kind) == {"attention", "expert"}
    assert all(0.02 < v["max_rel_err"] < 0.2 for v in by_kind.values()), by_kind
    assert 0.2 < report["size"]["export_bytes"] / report["size"]["source_bytes"] < 0.5


def test_weight_only_nvfp4_in_blocks_of_32_verifies(exports, tmp_path):
    """recipe=nvfp4_mlp_weight_only: W4A16_NVFP4, group size 32 (was refused as 'expected 16')."""
    d = exports["nvfp4_w32"]
    with open(os.path.join(d, "hf_quant_config.json")) as f:
        quant = json.load(f)["quantization"]
    assert (quant["quant_algo"], quant["group_size"]) == ("W4A16_NVFP4", 32)
    report = _verify(d, exports=exports, quantized_modules=set(exports["w32_quantized_modules"]),
                     quantize_experts=True)
    assert report["errors"] == [] and report["checks"]["quant_config"]["group_size"] == 32
    assert report["checks"]["modules"]["quantized"] == NUM_LAYERS * NUM_EXPERTS * 3
    quantized = [r for r in exports["w32_all"] if r.get("quantized")]
    assert len(quantized) == NUM_LAYERS * NUM_EXPERTS * 3
    assert all(r["bit_exact"] for r in exports["w32_all"]), [r for r in exports["w32_all"] if not r["bit_exact"]]
    # group size 32 is weight-only's: the same export declared as W4A4 NVFP4 is refused, naming it
    bad = _copy(exports, tmp_path, "nvfp4_w32")
    path = os.path.join(bad, "hf_quant_config.json")
    with open(path) as f:
        hqc = json.load(f)
    hqc["quantization"]["quant_algo"] = "NVFP4"
    with open(path, "w") as f:
        json.dump(hqc, f)
    errors = _verify(bad, exports=exports)["errors"]
    assert "hf_quant_config.json quantization.group_size=32, expected 16 for recipe format nvfp4 " \
           "(quant_algo 'NVFP4')" in errors, errors


def test_dequantized_export_equals_megatron_fake_quant_bit_exact(exports):
    results = exports["all"]
    quantized = [r for r in results if r.get("quantized")]
    assert len(quantized) == NUM_LAYERS * (4 + NUM_EXPERTS * 3), [r["module"] for r in results]
    assert [r for r in results if "error" in r] == []
    assert all(r["bit_exact"] and r["max_abs_diff"] == 0.0 for r in results), \
        [(r["module"], r["max_abs_diff"]) for r in results if not r["bit_exact"]]
    lm_head = [r for r in results if r["module"] == "lm_head"]
    assert lm_head and lm_head[0]["quantized"] is False  # excluded: compared as the raw weight


def test_samples_cover_each_kind_and_layer(exports):
    sampled = exports["sampled"]
    assert any(".experts." in n for n in sampled) and any("self_attn" in n for n in sampled)
    assert {n.split(".")[2] for n in sampled} == {"0", "1"}


def test_none_export_round_trip_is_bit_exact(exports):
    report = _verify(exports["none"], "none", exports=exports, quantized_modules=set())
    assert report["errors"] == []
    rt = report["checks"]["roundtrip"]
    assert rt["compared"] == 69 and rt["bit_exact"] == 69 and rt["dtype_casts"] == {}


def test_verify_without_source_uses_config_and_exclude_list(exports):
    from launcher.export.verify import verify_export

    report = verify_export(exports["nvfp4"], "nvfp4")
    assert report["errors"] == []
    assert report["checks"]["layers"]["num_experts"] == NUM_EXPERTS
    assert 0.25 < report["size"]["ratio_vs_bf16"] < 0.6  # fp32 embeddings / lm_head here


# ---------------------------------------------------------------- corruption is caught, by name

def test_missing_expert_tensor_is_named(exports, tmp_path):
    d = _copy(exports, tmp_path)
    name = "model.layers.1.mlp.experts.5.down_proj.weight_scale"
    _rewrite(d, lambda t: t.pop(name, None))
    report = _verify(d, exports=exports)
    assert not report["ok"]
    assert f"{name} is missing (quantized module needs it)" in report["errors"]
    assert f"tensor {name} is missing (the other experts of this layer have it)" in report["errors"]


def test_missing_whole_expert_is_named(exports, tmp_path):
    d = _copy(exports, tmp_path)
    prefix = "model.layers.0.mlp.experts.3."
    _rewrite(d, lambda t: [t.pop(k) for k in [k for k in t if k.startswith(prefix)]])
    report = _verify(d, exports=exports)
    assert ("model.layers.0.mlp.experts.3 (expert of layer 0) is missing: the model card has 8 experts"
            in report["errors"])
    assert (f"tensor {prefix}gate_proj.weight of the source checkpoint is missing from the export"
            in report["errors"])


def test_changed_dtype_is_named(exports, tmp_path):
    import torch

    d = _copy(exports, tmp_path)
    name = "model.layers.0.self_attn.q_proj.weight_scale"

    def edit(t):
        if name in t:
            t[name] = t[name].to(torch.bfloat16)

    _rewrite(d, edit)
    report = _verify(d, exports=exports)
    assert report["errors"] == [f"{name} has dtype bfloat16, expected float8_e4m3fn"]


def test_module_left_in_bf16_is_named(exports, tmp_path):
    """The silent-BF16 export (#1255/#569): an expert stored unquantized, scales dropped."""
    import torch

    from launcher.export.dequant import dequantize_nvfp4

    d = _copy(exports, tmp_path)
    m = "model.layers.1.mlp.experts.2.up_proj"

    def edit(t):
        if f"{m}.weight" in t:
            t[f"{m}.weight"] = dequantize_nvfp4(t[f"{m}.weight"], t.pop(f"{m}.weight_scale"),
                                                t.pop(f"{m}.weight_scale_2")).to(torch.float32)
            t.pop(f"{m}.input_scale")

    _rewrite(d, edit)
    report = _verify(d, exports=exports, quantized_modules=set(exports["quantized_modules"]))
    assert (f"{m}.weight stayed float32: the recipe quantized {m} (nvfp4) but the export holds no "
            "quantized weight for it") in report["errors"]
    # without the Megatron model's list (launch verify): unquantized and not declared excluded
    assert (f"{m} is an unquantized linear but hf_quant_config.json exclude_modules does not name it: a "
            "server would load it as nvfp4") in _verify(d, exports=exports)["errors"]


def test_empty_tensor_is_named(exports, tmp_path):
    import torch

    d = _copy(exports, tmp_path)
    name = "model.layers.1.mlp.experts.3.up_proj.weight"

    def edit(t):
        if name in t:
            t[name] = torch.zeros((0, t[name].shape[1]), dtype=torch.uint8)

    _rewrite(d, edit)
    report = _verify(d, exports=exports)
    assert f"tensor {name} [0, 32] is empty (0 elements)" in report["errors"]


def test_index_listing_a_missing_file_is_named(exports, tmp_path):
    d = _copy(exports, tmp_path)
    os.remove(os.path.join(d, "model-00002-of-00002.safetensors"))
    report = _verify(d, exports=exports)
    assert report["errors"][0] == ("model.safetensors.index.json lists file model-00002-of-00002.safetensors "
                                   "which is missing from the export")


def test_unindexed_shard_and_sidecar_are_named(exports, tmp_path):
    d = _copy(exports, tmp_path)
    shutil.copy(os.path.join(d, "model-00001-of-00002.safetensors"), os.path.join(d, "model-extra.safetensors"))
    with open(os.path.join(d, "model-00001-of-00002.json"), "w") as f:
        f.write("{}")
    errors = _verify(d, exports=exports)["errors"]
    assert "leftover per-layer sidecar file model-00001-of-00002.json (ModelOpt export metadata) in the export" in errors
    assert "shard model-extra.safetensors is present but model.safetensors.index.json does not list it" in errors
    assert any(e.startswith("tensor model.embed_tokens.weight is stored twice") for e in errors)


def test_swapped_expert_data_fails_value_check(exports, tmp_path):
    """Layout intact, wrong data (what EP>1 export does): dequantized vs source names the module."""
    d = _copy(exports, tmp_path)
    a, b = "model.layers.0.mlp.experts.1.down_proj", "model.layers.0.mlp.experts.6.down_proj"

    def edit(t):
        if f"{a}.weight" in t:
            for leaf in ("weight", "weight_scale", "weight_scale_2"):
                t[f"{a}.{leaf}"], t[f"{b}.{leaf}"] = t[f"{b}.{leaf}"], t[f"{a}.{leaf}"]

    _rewrite(d, edit)
    report = _verify(d, exports=exports, samples=1000)
    assert len(report["errors"]) == 2, report["errors"]
    assert report["errors"][0].startswith(f"{a}: dequantized weight is far from the source weight (relative error ")


def test_unquantized_linear_missing_from_exclude_modules_is_named(exports, tmp_path):
    """vLLM reads exclude_modules as the list of linears NOT to load quantized: an unquantized
    router left off it would be loaded as NVFP4."""
    d = _copy(exports, tmp_path)
    for name in ("hf_quant_config.json", "config.json"):
        path = os.path.join(d, name)
        with open(path) as f:
            data = json.load(f)
        section = data["quantization"] if name == "hf_quant_config.json" else data["quantization_config"]
        key = "exclude_modules" if name == "hf_quant_config.json" else "ignore"
        section[key] = [m for m in section[key] if m != "model.layers.1.mlp.gate"]
        with open(path, "w") as f:
            json.dump(data, f)
    expected = ["model.layers.1.mlp.gate is an unquantized linear but hf_quant_config.json exclude_modules does "
                "not name it: a server would load it as nvfp4"]
    assert _verify(d, exports=exports)["errors"] == expected          # launch verify: no Megatron model
    assert _verify(d, exports=exports, quantized_modules=set(exports["quantized_modules"]))["errors"] == expected


def test_wrong_format_and_missing_quant_config_are_reported(exports):
    errors = _verify(exports["nvfp4"], "fp8")["errors"]
    assert "hf_quant_config.json quantization.quant_algo='NVFP4', expected FP8 for recipe format fp8" in errors
    assert "config.json quantization_config.quant_algo='NVFP4', expected FP8 for recipe format fp8" in errors
    errors = _verify(exports["none"], "nvfp4")["errors"]
    assert "hf_quant_config.json is missing (recipe format nvfp4 needs quant_algo NVFP4 or W4A16_NVFP4)" in errors
    unlisted = [e for e in errors if e.endswith("is an unquantized linear but hf_quant_config.json "
                                                "exclude_modules does not name it: a server would load it as nvfp4")]
    assert unlisted[0].startswith("lm_head ")
    assert len([e for e in unlisted if not e.startswith("... and ")]) == 20    # capped, the rest counted:
    assert unlisted[-1].startswith("... and ")
    errors = _verify(exports["nvfp4"], "none")["errors"]
    assert "hf_quant_config.json exists but the recipe format is none" in errors


def test_card_disagreeing_with_export_is_reported(exports):
    from launcher.export.verify import verify_export

    errors = verify_export(exports["nvfp4"], "nvfp4", num_layers=4, num_experts=8)["errors"]
    assert "config.json says num_layers=2 but the model card says 4" in errors
    assert "layer 2 of the model card has no tensor in the export" in errors


# ---------------------------------------------------------------- CLI

def test_cli_verifies_and_fails_with_names(exports, tmp_path, capsys):
    from launcher.export.verify import verify_export_main

    assert verify_export_main([exports["nvfp4"], "--recipe", "nvfp4_default", "--source", exports["src"]]) == 0
    assert "VERIFIED" in capsys.readouterr().out
    d = _copy(exports, tmp_path)
    os.remove(os.path.join(d, "model-00001-of-00002.safetensors"))
    out_json = str(tmp_path / "report.json")
    assert verify_export_main([d, "--json", out_json]) == 1
    out = capsys.readouterr().out
    assert "FAIL: model.safetensors.index.json lists file model-00001-of-00002.safetensors" in out
    with open(out_json) as f:
        assert json.load(f)["ok"] is False
    assert verify_export_main([str(tmp_path / "nope"), "--recipe", "none"]) == 2
    assert verify_export_main([exports["nvfp4"], "--recipe", "int4_whatever"]) == 2


# ---------------------------------------------------------------- dequantization vs ModelOpt (no ranks)

def test_nvfp4_dequant_matches_modelopt_and_nibble_order():
    import torch
    from modelopt.torch.quantization.qtensor import NVFP4QTensor

    from launcher.export.dequant import dequantize_nvfp4, pack_e2m1, unpack_e2m1

    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(0))
    q, scale, scale_2 = NVFP4QTensor.quantize(w, 16)
    ref = q.dequantize(dtype=torch.float32, scale=scale, double_scale=scale_2, block_sizes={-1: 16})
    mine = dequantize_nvfp4(q._quantized_data, scale, scale_2)
    assert torch.equal(mine, ref)
    codes = torch.tensor([[1, 7, 9, 15]])            # 0.5, 6, -0.5, -6
    packed = pack_e2m1(codes)
    assert packed.tolist() == [[0x71, 0xF9]]          # element 0 in the LOW nibble
    assert unpack_e2m1(packed).tolist() == [[0.5, 6.0, -0.5, -6.0]]


def test_fp8_dequant():
    import torch

    from launcher.export.dequant import dequantize_fp8

    w = torch.randn(8, 16)
    scale = w.abs().max() / 448.0
    q = (w / scale).to(torch.float8_e4m3fn)
    assert torch.equal(dequantize_fp8(q, scale), q.float() * scale)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        dequantize_fp8(w, scale)


# ---------------------------------------------------------------- config validation refuses EP>1 / TP>1 export

@pytest.mark.parametrize("key", ["ep", "tp"])
def test_export_at_ep_or_tp_above_one_is_refused(key):
    from launcher.config.compose import ConfigError, compose_example
    from launcher.config.validate import validate

    example = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                           "examples/tiny/Qwen3-MoE-tiny/megatron_lm_ptq.yaml")
    cfg = compose_example(example, [f"stages.export.parallel.{key}=4", "stages.export.parallel.pp=1"])
    with pytest.raises(ConfigError, match=rf"stages\.export\.parallel\.{key}=4: must be 1: ModelOpt's "
                                          r"Megatron->HF export silently corrupts"):
        validate(cfg, check_paths=False)


# ---------------------------------------------------------------- the stated tolerance vs Megatron references

def _references_from_export(d: str, modules: list[str]) -> dict:
    from launcher.export.safetensors_dir import read_all_headers
    from launcher.export.verify_values import dequantized

    tensors, _ = read_all_headers(d)
    return {m: ("expert", t) for m, t in dequantized(d, modules, tensors, "nvfp4").items()}


def test_reference_tolerance_admits_no_rounding_flip(exports):
    """The gate folds the exporter's own codes (launcher.megatron.fold): one element one E2M1 step
    off the export fails, naming the module and the count; many, or wrong data, fail too."""
    from launcher.export.dequant import quantization_step
    from launcher.export.safetensors_dir import load_tensors, read_all_headers
    from launcher.export.verify_values import MAX_FLIP_FRACTION, compare_references

    assert MAX_FLIP_FRACTION == {"nvfp4": 0.0, "fp8": 0.0, "none": 0.0}
    d = exports["nvfp4"]
    a, b = "model.layers.0.mlp.experts.1.gate_proj", "model.layers.0.mlp.experts.2.gate_proj"
    refs = _references_from_export(d, [a, b])
    tensors, _ = read_all_headers(d)
    parts = load_tensors(d, [f"{a}.{leaf}" for leaf in ("weight", "weight_scale", "weight_scale_2")], tensors)
    step = quantization_step("nvfp4", {k.rsplit(".", 1)[1]: v for k, v in parts.items()})
    one_tie = refs[a][1].clone()
    one_tie[3, 5] += step[3, 5]
    [flip] = compare_references(d, {a: ("expert", one_tie)}, "nvfp4")
    assert flip["mismatched"] == flip["flips"] == 1 and flip["bit_exact"] is False
    assert (flip["flip_blocks"], flip["blocks"]) == (1, one_tie.numel() // 16)
    assert flip["error"] == (
        f"{a}: exported weight differs from the Megatron model's gated (exporter-arithmetic) weight: 1 of "
        f"{one_tie.numel()} elements rounded differently (max |diff| {flip['max_abs_diff']:.3e}), 0 of them "
        f"beyond one quantization step (allowed: none, the gate folds the codes the export writes)"), flip
    many = refs[a][1] + step   # every element one step off
    [bad] = compare_references(d, {a: ("expert", many)}, "nvfp4")
    assert bad["error"].startswith(f"{a}: exported weight differs from the Megatron model's gated "
                                   f"(exporter-arithmetic) weight: {many.numel()} of {many.numel()} elements "
                                   f"rounded differently")
    [swapped] = compare_references(d, {a: ("expert", refs[b][1])}, "nvfp4")
    assert "beyond one quantization step" in swapped["error"]
    [exact] = compare_references(d, {a: refs[a]}, "nvfp4")
    assert "error" not in exact and exact["bit_exact"] and exact["max_abs_diff"] == 0.0


def test_quantization_step_is_the_gap_to_a_neighbouring_e2m1_value():
    import torch

    from launcher.export.dequant import E2M1_MAGNITUDES, dequantize_nvfp4, pack_e2m1, quantization_step

    codes = torch.arange(16).repeat(2).reshape(2, 16)
    packed = pack_e2m1(codes)
    scale = torch.full((2, 1), 2.0).to(torch.float8_e4m3fn)
    scale_2 = torch.tensor(0.5)
    values = dequantize_nvfp4(packed, scale, scale_2)
    step = quantization_step("nvfp4", {"weight": packed, "weight_scale": scale, "weight_scale_2": scale_2})
    mags = sorted(E2M1_MAGNITUDES)
    for i, code in enumerate(codes[0].tolist()):
        m = E2M1_MAGNITUDES[code & 7]
        k = mags.index(m)
        neighbours = [abs(mags[j] - m) for j in (k - 1, k + 1) if 0 <= j < len(mags)]
        assert step[0, i].item() == max(neighbours) * 1.0, (code, step[0, i])
        assert values[0, i].item() == (-m if code & 8 else m) * 1.0
