"""The export stage end to end on 4 gloo ranks: the quantize stage saves the tiny Qwen3-MoE at EP4,
the export stage reloads it at PP4, exports through ModelOpt and verifies the result.

One subprocess launch per recipe runs both stages in each rank process (quantize at EP4, then
Megatron's groups are rebuilt at PP4 for export), which saves a second start-up (~20 s of
imports per rank on this machine).  The tiny model of ``python -m launcher.tiny`` is used when
it is built; otherwise a random 4-layer Qwen3-MoE (same shape family).
"""
from __future__ import annotations

import json
import os

import pytest

from distributed_utils import run_on_ranks, write_tiny_qwen3_moe

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _stage_ctx(name: str, cfg, run_dir: str):
    from launcher.config.validate import stage_dims
    from launcher.stages.context import StageContext

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return StageContext(name=name, cfg=cfg, run_dir=run_dir, rank=rank, world_size=world,
                        local_rank=rank, dims=stage_dims(cfg, name), device="cpu")


def pipelines_worker(runs: list) -> dict:
    """For each (cfg_yaml, run_dir): the enabled stages among quantize and export, in order."""
    from omegaconf import OmegaConf

    from launcher.megatron.dist import init_distributed, shutdown
    from launcher.stages import export, quantize
    from launcher.stages.context import StageFailed

    out = {}
    for cfg_yaml, run_dir in runs:
        cfg = OmegaConf.create(cfg_yaml)
        for name, module in (("quantize", quantize), ("export", export)):
            if cfg.stages[name].enabled:
                ctx = _stage_ctx(name, cfg, run_dir)
                init_distributed(ctx.dims, "cpu", timeout_s=180, seed=int(cfg.seed))
                module.run(ctx)
        # a second export must refuse to replace the verified one (overwrite is false)
        try:
            export.run(_stage_ctx("export", cfg, run_dir))
            out[run_dir] = "ran"
        except StageFailed as e:
            out[run_dir] = str(e)
    shutdown()
    return out


def _tiny_source(tmp_path_factory) -> str:
    from launcher.config.compose import cache_dir

    built = os.path.join(cache_dir(), "tiny", "Qwen3-MoE-tiny", "hf")
    if os.path.isfile(os.path.join(built, "config.json")):
        return built
    return write_tiny_qwen3_moe(str(tmp_path_factory.mktemp("tiny_src") / "hf"), num_layers=4)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    src = _tiny_source(tmp_path_factory)
    calib = str(tmp_path_factory.mktemp("calib") / "calib.jsonl")
    with open(calib, "w") as f:
        for i in range(16):
            f.write(json.dumps({"text": f"calibration text {i}: " + "the quick brown fox jumps " * 8}) + "\n")
    return src, calib


def _config(src: str, calib: str, recipe: str, runs_root: str, quantize: bool = True) -> str:
    from omegaconf import OmegaConf

    from launcher.config import schema
    from launcher.config.compose import RECIPES_DIR
    from launcher.config.hf_card import card_from_hf_config, read_hf_config

    card = {**card_from_hf_config(read_hf_config(src)), "name": "tiny", "path": src}
    cfg = OmegaConf.merge(OmegaConf.structured(schema.PipelineConfig), {
        "job_name": f"export-{recipe}", "runs_root": runs_root,
        "model": OmegaConf.merge(OmegaConf.structured(schema.ModelCard), card),
        "recipe": OmegaConf.merge(OmegaConf.structured(schema.RecipeConfig),
                                  OmegaConf.load(os.path.join(RECIPES_DIR, f"{recipe}.yaml"))),
        "executor": OmegaConf.structured(schema.LocalExecutorConfig),
        "stages": {
            "quantize": {"enabled": quantize, "parallel": {"ep": 4, "world_size": 4},
                         "calib": {"dataset": calib, "size": 8, "max_seq_len": 32, "batch_size": 4}},
            "mmlu": {"enabled": False, "dataset": "unused"},
            "export": {"parallel": {"pp": 4, "world_size": 4}, "verify_samples": 4},
        },
    })
    return OmegaConf.to_yaml(cfg, resolve=True)


RUNS = {"nvfp4": ("nvfp4_default", True), "none": ("none", True), "none_hf": ("none", False)}


@pytest.fixture(scope="module")
def pipelines(source, tmp_path_factory):
    """One 4-rank launch: NVFP4 and none (quantize at EP4 -> export at PP4), and none exported
    straight from the HF weights (stages.quantize disabled)."""
    src, calib = source
    root = tmp_path_factory.mktemp("export_stage")
    runs = {key: (_config(src, calib, recipe, str(root), quantize), str(root / key))
            for key, (recipe, quantize) in RUNS.items()}
    [rank0, *_] = run_on_ranks("test_export_stage:pipelines_worker", nprocs=4,
                               kwargs={"runs": list(runs.values())}, timeout_s=560)
    out = {}
    for key, (_, run_dir) in runs.items():
        with open(os.path.join(run_dir, "export", "verify.json")) as f:
            out[key] = (run_dir, json.load(f), rank0[run_dir])
    return out


def _assert_published(run_dir: str, report: dict, second_export: str) -> None:
    final = os.path.join(run_dir, "export", "hf")
    assert report["ok"] is True, report["errors"]
    assert report["export_dir"] == final
    assert sorted(os.listdir(os.path.join(run_dir, "export"))) == ["hf", "verify.json"]  # no tmp, no rejected
    assert not [n for n in os.listdir(final) if n.startswith("model-") and n.endswith(".json")]  # no sidecars
    assert report["layout"]["pp"] == 4 and report["layout"]["ep"] == 1
    assert second_export.startswith(f"{final} exists; refusing to overwrite it")


def test_nvfp4_saved_at_ep4_exported_at_pp4_verifies(pipelines):
    run_dir, report, second = pipelines["nvfp4"]
    _assert_published(run_dir, report, second)
    assert "'ep': 4" in report["loaded_from"]
    checks = report["checks"]
    assert checks["quant_config"]["quant_algo"] == "NVFP4"
    assert checks["layers"] == {"num_layers": 4, "num_experts": 8, "moe_layers": 4}
    assert checks["names_vs_source"]["missing"] == 0 and checks["names_vs_source"]["extra"] == 0
    assert checks["modules"]["quantized"] == 4 * (4 + 8 * 3)
    mega = checks["dequant_vs_megatron"]
    # references came from the ranks holding each layer: every PP stage contributed
    assert {m.split(".")[2] for m in mega["modules"] if m.startswith("model.layers.")} == {"0", "1", "2", "3"}
    for kind in ("attention", "expert"):
        k = mega["by_kind"][kind]
        assert k["modules"] >= 4 and k["bit_exact"] == k["modules"] and k["max_abs_diff"] == 0.0, mega


@pytest.mark.parametrize("key", ["none", "none_hf"])
def test_recipe_none_round_trip_is_bit_exact(pipelines, key):
    run_dir, report, second = pipelines[key]
    _assert_published(run_dir, report, second)
    assert ("'ep': 4" in report["loaded_from"]) if key == "none" else ("stages.quantize disabled" in report["loaded_from"])
    assert report["quant_algo"] is None
    rt = report["checks"]["roundtrip"]
    assert rt["compared"] == report["checks"]["names_vs_source"]["source_tensors"] == rt["bit_exact"]
    assert report["checks"]["modules"]["quantized"] == 0
    mega = report["checks"]["dequant_vs_megatron"]["by_kind"]
    assert all(k["bit_exact"] == k["modules"] for k in mega.values()), mega
    assert not os.path.exists(os.path.join(run_dir, "export", "hf", "hf_quant_config.json"))
