"""The quantize stage on 4 gloo ranks at EP4 (NVFP4), and its checks; recipes and calibration units.

One 4-rank EP4 run (module fixture): (1) recipes/nvfp4_default.yaml through the stage ->
summary.json with every expert quantized and a dist checkpoint; (2) the same recipe with the
experts excluded -> StageFailed on every rank, summary.json says why, no checkpoint; (3) the other
shipped recipes (fp8_default, nvfp4_awq_lite, nvfp4_mlp_weight_only) quantize the MoE.
"""
from __future__ import annotations

import json
import os

import pytest

from launcher_testing.checkpoints import write_byte_tokenizer, write_tiny_qwen3_moe
from launcher_testing.ranks import REPO_ROOT, run_on_ranks

NUM_LAYERS, NUM_EXPERTS = 2, 8

pytestmark = pytest.mark.torch   # imports torch, Megatron or ModelOpt (in-process or in its ranks)


def write_calibration_jsonl(path: str, n: int = 12) -> str:
    words = "the quick brown fox jumps over a lazy dog while seven experts route every token".split()
    with open(path, "w") as f:
        for i in range(n - 1):
            f.write(json.dumps({"text": " ".join(words[(i + j) % len(words)] for j in range(20))}) + "\n")
        f.write(json.dumps({"messages": [{"role": "user", "content": "quantize me"},
                                         {"role": "assistant", "content": "in NVFP4, gladly"}]}) + "\n")
    return path


def stage_config(hf_path: str, calib_path: str, recipe_file: str, exclude_modules: list[str], layout: dict):
    from omegaconf import OmegaConf

    from launcher.schema import ModelCard, RecipeConfig, Stages

    recipe = OmegaConf.merge(OmegaConf.structured(RecipeConfig), OmegaConf.load(recipe_file))
    recipe.exclude_modules = exclude_modules
    stages = OmegaConf.merge(OmegaConf.structured(Stages), {"quantize": {
        "parallel": layout, "calib": {"dataset": calib_path, "size": 8, "max_seq_len": 24, "batch_size": 2}}})
    model = OmegaConf.structured(ModelCard(
        name="tiny-qwen3-moe", architecture="Qwen3MoeForCausalLM", path=hf_path, num_layers=NUM_LAYERS,
        hidden_size=64, num_attention_heads=4, num_query_groups=2, num_experts=NUM_EXPERTS, moe_topk=2))
    return OmegaConf.create({"job_name": "test-quantize", "seed": 1234, "model": model, "recipe": recipe,
                             "stages": stages})


def quantize_each_recipe(hf_path: str, recipe_names: list[str]) -> dict:
    """Each shipped recipe through resolve_quant_cfg + mtq.quantize on the Megatron MoE, at EP4
    unless check_recipe_layout refuses EP4 for it (then at EP1, DP4)."""
    import torch
    from omegaconf import OmegaConf

    import modelopt.torch.quantization as mtq
    from launcher.schema import RecipeConfig
    from launcher.megatron.forward import forward_logits
    from launcher.megatron.hf_io import import_hf_weights
    from launcher.megatron.models import build_model, unwrap_model
    from launcher.megatron.dist import init_distributed
    from launcher.quant.recipes import check_recipe_layout, resolve_quant_cfg
    from launcher.quant.summary import check_summary, gather_summary
    from launcher.topology import ParallelDims

    gen = torch.Generator().manual_seed(2)
    calib = [torch.randint(0, 256, (2, 32), generator=gen) for _ in range(2)]
    out = {}
    for name in recipe_names:
        recipe = OmegaConf.merge(OmegaConf.structured(RecipeConfig),
                                 OmegaConf.load(os.path.join(REPO_ROOT, "recipes", f"{name}.yaml")))
        cfg = resolve_quant_cfg(recipe)
        try:
            check_recipe_layout(cfg, 4, name)
            ep, refused_at_ep4 = 4, None
        except ValueError as e:
            ep, refused_at_ep4 = 1, str(e)
        dims = ParallelDims(world_size=int(os.environ["WORLD_SIZE"]), ep=ep)
        init_distributed(dims, "cpu", timeout_s=90, seed=1234)
        model = build_model(hf_path, dims, "cpu", "float32", "alltoall")
        import_hf_weights(model, hf_path, "float32")
        reference = forward_logits(model, calib[0])
        mtq.quantize(unwrap_model(model), cfg,
                     lambda _: [forward_logits(model, b) for b in calib])
        logits = forward_logits(model, calib[0])
        summary = gather_summary(model)
        out[name] = {"ep": ep, "refused_at_ep4": refused_at_ep4,
                     "enabled_by_format": summary["enabled_by_format"],
                     "attention_weight_quantized": summary["by_module_kind"]["attention"]["weight_quantized"],
                     "relative_error": float((logits - reference).norm() / reference.norm()),
                     "problems": check_summary(summary, True, bool(recipe.quantize_experts))}
    return out


def quantize_worker(hf_path: str, calib_path: str, runs: list[dict], recipe_names: list[str]) -> dict:
    """At EP4: the quantize stage once per entry of ``runs`` ({run_dir, recipe_file,
    exclude_modules}), then every recipe in ``recipe_names`` through the building blocks."""
    from launcher.megatron.dist import init_distributed, shutdown
    from launcher.stages import quantize
    from launcher.stages.context import StageContext, StageFailed
    from launcher.topology import ParallelDims

    layout = {"ep": 4}
    dims = ParallelDims(world_size=int(os.environ["WORLD_SIZE"]), **layout)
    out = {"stage": {}}
    for spec in runs:
        cfg = stage_config(hf_path, calib_path, spec["recipe_file"], spec["exclude_modules"], layout)
        init_distributed(dims, "cpu", timeout_s=90, seed=cfg.seed)
        ctx = StageContext(name="quantize", cfg=cfg, run_dir=spec["run_dir"], rank=int(os.environ["RANK"]),
                           world_size=dims.world_size, local_rank=int(os.environ["LOCAL_RANK"]), dims=dims,
                           device="cpu")
        try:
            quantize.run(ctx)
            out["stage"][spec["run_dir"]] = "ok"
        except StageFailed as e:
            out["stage"][spec["run_dir"]] = f"StageFailed: {e}"
    out["recipes"] = quantize_each_recipe(hf_path, recipe_names)
    shutdown()
    return out


RECIPES_CHECKED = ["fp8_default", "nvfp4_awq_lite", "nvfp4_mlp_weight_only"]


@pytest.fixture(scope="module")
def quantize_run(tmp_path_factory):
    """One 4-rank EP4 job shared by the slow tests below (each 4-rank start costs 25-50 s)."""
    root = tmp_path_factory.mktemp("quantize_run")
    hf_path = write_tiny_qwen3_moe(str(root / "tiny_qwen3_moe"), num_layers=NUM_LAYERS)
    calib = write_calibration_jsonl(str(root / "calib.jsonl"))
    good, excluded = str(root / "run_nvfp4"), str(root / "run_excluded")
    recipe = os.path.join(REPO_ROOT, "recipes", "nvfp4_default.yaml")
    results = run_on_ranks("test_quantize:quantize_worker", nprocs=4, timeout_s=400, kwargs={
        "hf_path": hf_path, "calib_path": calib, "recipe_names": RECIPES_CHECKED, "runs": [
            {"run_dir": good, "recipe_file": recipe, "exclude_modules": []},
            {"run_dir": excluded, "recipe_file": recipe, "exclude_modules": ["*mlp.experts*"]}]})
    return {"good": good, "excluded": excluded, "results": results}


@pytest.mark.slow
def test_quantize_stage_nvfp4_ep4_quantizes_every_expert(quantize_run):
    good = quantize_run["good"]
    assert all(r["stage"][good] == "ok" for r in quantize_run["results"]), quantize_run["results"]
    summary = json.load(open(os.path.join(good, "quantize", "summary.json")))
    s = summary["summary"]
    assert summary["checks"] == {"passed": True, "problems": []}
    assert s["expert_linears"] == NUM_LAYERS * NUM_EXPERTS * 2
    assert s["expert_linears_weight_quantized"] == s["expert_linears"] and s["unquantized_expert_linears"] == []
    assert set(s["enabled_by_format"]) == {"nvfp4"}
    kinds = s["by_module_kind"]
    assert kinds["experts"]["weight:nvfp4"] == NUM_LAYERS * NUM_EXPERTS * 2
    assert kinds["attention"]["weight:nvfp4"] == NUM_LAYERS * 2          # linear_qkv, linear_proj
    assert kinds["router"] == {"modules": NUM_LAYERS, "weight_quantized": 0, "quantizers": 0, "enabled": 0}
    assert kinds["output_layer"]["modules"] == 1 and kinds["output_layer"]["enabled"] == 0
    assert kinds["embedding"]["weight_quantized"] == 0
    assert summary["calibration"]["batches"] == 4 and summary["calibration"]["samples"] == 8
    assert summary["versions"]["megatron-core"] and summary["versions"]["nvidia-modelopt"]
    assert 0 < summary["logits_relative_error_calib_batch0"] < 0.5
    ckpt = os.path.join(good, "quantize", "checkpoint")
    assert os.path.isdir(os.path.join(ckpt, "modelopt_state"))
    marker = json.load(open(os.path.join(ckpt, "launcher_checkpoint.json")))
    assert marker == {"saved_at_layout": {"world_size": 4, "tp": 1, "pp": 1, "ep": 4, "etp": 1, "cp": 1},
                      "modelopt_state": True}
    assert not [n for n in os.listdir(os.path.join(good, "quantize")) if ".tmp" in n]


@pytest.mark.slow
def test_quantize_stage_fails_when_experts_are_excluded(quantize_run):
    excluded = quantize_run["excluded"]
    outcomes = [r["stage"][excluded] for r in quantize_run["results"]]
    assert all(o.startswith("StageFailed") and "expert linears" in o for o in outcomes), outcomes
    bad = json.load(open(os.path.join(excluded, "quantize", "summary.json")))
    assert bad["checks"]["passed"] is False
    assert bad["summary"]["expert_linears_weight_quantized"] == 0
    assert not os.path.exists(os.path.join(excluded, "quantize", "checkpoint"))


@pytest.mark.slow
def test_every_quantizing_recipe_quantizes_the_moe(quantize_run):
    result = quantize_run["results"][0]["recipes"]
    print(json.dumps(result, indent=1))
    for name in RECIPES_CHECKED:
        assert result[name]["problems"] == [], (name, result[name])
        assert 0 < result[name]["relative_error"] < 0.6, (name, result[name])
    assert set(result["fp8_default"]["enabled_by_format"]) == {"fp8"} and result["fp8_default"]["ep"] == 4
    assert set(result["nvfp4_awq_lite"]["enabled_by_format"]) == {"nvfp4"}
    # awq calibration desyncs EP ranks in ModelOpt 0.47: refused at EP4, works at EP1 (DP4)
    assert result["nvfp4_awq_lite"]["ep"] == 1 and "awq_lite" in result["nvfp4_awq_lite"]["refused_at_ep4"]
    # weight-only MLP recipe: expert weights only, attention untouched
    assert result["nvfp4_mlp_weight_only"]["attention_weight_quantized"] == 0
    assert result["nvfp4_mlp_weight_only"]["enabled_by_format"] == {"nvfp4": NUM_LAYERS * NUM_EXPERTS * 2}


# ---------------------------------------------------------------- single-process units


def test_recipes_resolve_and_reject():
    from omegaconf import OmegaConf

    from launcher.schema import RecipeConfig
    from launcher.quant.recipes import resolve_quant_cfg

    loaded = {}
    for name in ("nvfp4_default", "fp8_default", "nvfp4_awq_lite", "nvfp4_mlp_weight_only", "none"):
        recipe = OmegaConf.merge(OmegaConf.structured(RecipeConfig),
                                 OmegaConf.load(os.path.join(REPO_ROOT, "recipes", f"{name}.yaml")))
        assert recipe.name == name
        loaded[name] = resolve_quant_cfg(recipe)
    assert loaded["none"] is None
    assert all(isinstance(loaded[n]["quant_cfg"], list) for n in loaded if n != "none")
    with_excl = resolve_quant_cfg(RecipeConfig(name="x", format="nvfp4", modelopt_cfg="NVFP4_DEFAULT_CFG",
                                               exclude_modules=["*experts*"]))
    assert with_excl["quant_cfg"][-1] == {"quantizer_name": "*experts*", "enable": False}
    from launcher.quant.recipes import check_recipe_layout

    with pytest.raises(ValueError, match="ep=1"):
        check_recipe_layout(loaded["nvfp4_awq_lite"], ep=4, recipe_name="nvfp4_awq_lite")
    check_recipe_layout(loaded["nvfp4_awq_lite"], ep=1)
    check_recipe_layout(loaded["nvfp4_default"], ep=8)
    with pytest.raises(ValueError, match="NVFP4_DEFAULT_CFG"):   # lists the valid names
        resolve_quant_cfg(RecipeConfig(name="x", format="nvfp4", modelopt_cfg="NVFP5_CFG"))
    with pytest.raises(ValueError, match="exactly one"):
        resolve_quant_cfg(RecipeConfig(name="x", format="fp8", modelopt_cfg=None, recipe_path=None))
    with pytest.raises(ValueError, match="valid values"):
        resolve_quant_cfg(RecipeConfig(name="x", format="fp9", modelopt_cfg="FP8_DEFAULT_CFG"))


def test_calibration_sources_give_identical_batches(tmp_path):
    from transformers import AutoTokenizer

    from launcher.quant.calibration import build_calibration_batches, load_calibration_texts

    write_byte_tokenizer(str(tmp_path / "tok"))
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    jsonl = write_calibration_jsonl(str(tmp_path / "c.jsonl"), n=4)
    texts = load_calibration_texts(jsonl, size=10, tokenizer=tok)
    assert len(texts) == 4 and texts[-1] == "<|user|>quantize me\n<|assistant|>in NVFP4, gladly\n"
    (tmp_path / "c.txt").write_text("first paragraph\nstill first\n\nsecond one\n\n\n")
    assert load_calibration_texts(str(tmp_path / "c.txt"), size=5) == ["first paragraph\nstill first", "second one"]
    import datasets

    datasets.Dataset.from_dict({"text": texts[:3]}).save_to_disk(str(tmp_path / "ds"))
    assert load_calibration_texts(str(tmp_path / "ds"), size=10) == texts[:3]
    a = build_calibration_batches(tok, texts, size=5, max_seq_len=16, batch_size=2)
    b = build_calibration_batches(tok, texts, size=5, max_seq_len=16, batch_size=2)
    assert [t.shape for t in a] == [(2, 16), (2, 16), (1, 16)]
    assert all((x == y).all() for x, y in zip(a, b))
    with pytest.raises(ValueError, match="neither"):
        (tmp_path / "bad.jsonl").write_text(json.dumps({"prompt": "x"}) + "\n")
        load_calibration_texts(str(tmp_path / "bad.jsonl"), size=1)
    with pytest.raises(ValueError, match="does not exist"):
        load_calibration_texts(str(tmp_path / "missing.jsonl"), size=1)


def test_summary_check_flags_unquantized_experts():
    from launcher.quant.summary import check_summary, module_kind, summarize

    assert module_kind("decoder.layers.3.mlp.experts.local_experts.5.linear_fc1") == "experts"
    assert module_kind("decoder.layers.3.mlp.router") == "router"
    assert module_kind("decoder.layers.0.self_attention.linear_qkv") == "attention"
    rows = [{"name": f"e{i}.weight_quantizer", "module": f"e{i}", "kind": "experts", "role": "weight",
             "format": "nvfp4", "enabled": i != 1} for i in range(3)]
    s = summarize(rows, {"e0": "experts", "e1": "experts", "e2": "experts", "r": "router"})
    assert s["unquantized_expert_linears"] == ["e1"]
    assert any("1 of 3 expert linears" in p for p in check_summary(s, True, True))
    assert check_summary(s, True, False) == []
    assert s["by_module_kind"]["router"] == {"modules": 1, "weight_quantized": 0, "quantizers": 0, "enabled": 0}
    empty = summarize([], {})
    assert check_summary(empty, True, True) == ["the recipe should quantize, but mtq.quantize left no quantizer enabled"]
    assert check_summary(empty, False, True) == []
