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


def quantize_then_export_worker(cfg_yaml: str, run_dir: str) -> dict:
    from omegaconf import OmegaConf

    from launcher.megatron.dist import init_distributed, shutdown
    from launcher.stages import export, quantize
    from launcher.stages.context import StageFailed

    cfg = OmegaConf.create(cfg_yaml)
    out = {}
    for name, module in (("quantize", quantize), ("export", export)):
        ctx = _stage_ctx(name, cfg, run_dir)
        init_distributed(ctx.dims, "cpu", timeout_s=180, seed=int(cfg.seed))
        module.run(ctx)
    # a second export must refuse to replace the verified one (overwrite is false)
    try:
        export.run(_stage_ctx("export", cfg, run_dir))
        out["second_export"] = "ran"
    except StageFailed as e:
        out["second_export"] = str(e)
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


def _config(src: str, calib: str, recipe: str, runs_root: str) -> str:
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
            "quantize": {"parallel": {"ep": 4, "world_size": 4},
                         "calib": {"dataset": calib, "size": 8, "max_seq_len": 32, "batch_size": 4}},
            "mmlu": {"enabled": False, "dataset": "unused"},
            "export": {"parallel": {"pp": 4, "world_size": 4}, "verify_samples": 4},
        },
    })
    return OmegaConf.to_yaml(cfg, resolve=True)


def _run(source, tmp_path, recipe: str) -> tuple[str, dict, dict]:
    src, calib = source
    run_dir = str(tmp_path / "run")
    results = run_on_ranks("test_export_stage:quantize_then_export_worker", nprocs=4,
                           kwargs={"cfg_yaml": _config(src, calib, recipe, str(tmp_path)), "run_dir": run_dir},
                           timeout_s=420)
    with open(os.path.join(run_dir, "export", "verify.json")) as f:
        report = json.load(f)
    return run_dir, report, results[0]


def _assert_published(run_dir: str, report: dict) -> None:
    final = os.path.join(run_dir, "export", "hf")
    assert report["ok"] is True, report["errors"]
    assert report["export_dir"] == final
    assert sorted(os.listdir(os.path.join(run_dir, "export"))) == ["hf", "verify.json"]  # no tmp, no rejected
    assert not [n for n in os.listdir(final) if n.startswith("model-") and n.endswith(".json")]  # no sidecars
    assert report["layout"]["pp"] == 4 and report["layout"]["ep"] == 1
    assert "saved at" in report["loaded_from"] and "'ep': 4" in report["loaded_from"]


def test_nvfp4_saved_at_ep4_exported_at_pp4_verifies(source, tmp_path):
    run_dir, report, rank0 = _run(source, tmp_path, "nvfp4_default")
    _assert_published(run_dir, report)
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
    assert "refusing to overwrite" in rank0["second_export"]


def test_recipe_none_round_trip_is_bit_exact(source, tmp_path):
    run_dir, report, rank0 = _run(source, tmp_path, "none")
    _assert_published(run_dir, report)
    assert report["quant_algo"] is None
    rt = report["checks"]["roundtrip"]
    assert rt["compared"] == report["checks"]["names_vs_source"]["source_tensors"] == rt["bit_exact"]
    assert report["checks"]["modules"]["quantized"] == 0
    assert not os.path.exists(os.path.join(run_dir, "export", "hf", "hf_quant_config.json"))
    assert "refusing to overwrite" in rank0["second_export"]
