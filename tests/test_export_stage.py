"""The export stage end to end on 4 gloo ranks: the quantize stage saves the tiny Qwen3-MoE at EP4,
the export stage reloads it at PP4, exports through ModelOpt and verifies the result.

One subprocess launch per recipe runs both stages in each rank process (quantize at EP4, then
Megatron's groups are rebuilt at PP4 for export), which saves a second start-up (~20 s of
imports per rank on this machine).  The tiny model of ``python -m launcher_testing.tiny`` is used when
it is built; otherwise a random 4-layer Qwen3-MoE (same shape family).
"""
from __future__ import annotations

import json
import os

import pytest

from launcher_testing.checkpoints import write_tiny_qwen3_moe
from launcher_testing.ranks import run_on_ranks

pytestmark = pytest.mark.torch   # quantize and export on 4 gloo ranks

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _stage_ctx(name: str, cfg, run_dir: str, device: str = "cpu"):
    from launcher.topology import ParallelDims
    from launcher.stages.context import StageContext

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return StageContext(name=name, cfg=cfg, run_dir=run_dir, rank=rank, world_size=world,
                        local_rank=rank, dims=ParallelDims.from_stage(cfg, name), device=device)


def _attempt(run, *args) -> str:
    from launcher.stages.context import StageFailed

    try:
        run(*args)
        return "ran"
    except StageFailed as e:
        return str(e)


def pipelines_worker(runs: list, device: str = "cpu") -> dict:
    """For each (cfg_yaml, run_dir, wrong_format): quantize (if enabled) and export; then a second
    export (must refuse: overwrite is false); with ``wrong_format``, a re-export with
    overwrite=true verified against that format (must fail verification)."""
    from omegaconf import OmegaConf

    from launcher.megatron.dist import init_distributed, shutdown
    from launcher.stages import export, quantize

    out = {}
    for cfg_yaml, run_dir, wrong_format in runs:
        cfg = OmegaConf.create(cfg_yaml)
        for name, module in (("quantize", quantize), ("export", export)):
            if cfg.stages[name].enabled:
                ctx = _stage_ctx(name, cfg, run_dir, device)
                init_distributed(ctx.dims, device, timeout_s=180, seed=int(cfg.seed),
                                 architecture=cfg.model.architecture)
                module.run(ctx)
        final = os.path.join(run_dir, "export", "hf")
        with open(os.path.join(run_dir, "export", "verify.json")) as f:
            res = {"report": json.load(f),
                   "export_listing": sorted(os.listdir(os.path.dirname(final))),
                   "file_modes": {n: os.stat(os.path.join(final, n)).st_mode & 0o777 for n in os.listdir(final)}}
        res["second_export"] = _attempt(export.run, _stage_ctx("export", cfg, run_dir, device))
        if wrong_format:
            cfg.recipe.format = wrong_format
            cfg.stages.export.overwrite = True
            res["wrong_format_export"] = _attempt(export.run, _stage_ctx("export", cfg, run_dir, device))
            with open(os.path.join(run_dir, "export", "verify.json")) as f:
                res["wrong_format_report"] = json.load(f)
            res["after_failure"] = sorted(os.listdir(os.path.join(run_dir, "export")))
        out[run_dir] = res
    shutdown()
    return out


def _tiny_source(tmp_path_factory) -> str:
    from launcher.paths import cache_dir

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


def _config(src: str, calib: str, recipe: str, runs_root: str, quantize: bool = True,
            quantize_parallel=None, export_parallel=None) -> str:
    from omegaconf import OmegaConf

    from launcher import schema
    from launcher.paths import RECIPES_DIR
    from launcher.config.hf_card import card_from_hf_config
    from launcher.hf_config import read_hf_config

    card = {**card_from_hf_config(read_hf_config(src)), "name": "tiny", "path": src}
    cfg = OmegaConf.merge(OmegaConf.structured(schema.PipelineConfig), {
        "job_name": f"export-{recipe}", "runs_root": runs_root,
        "model": OmegaConf.merge(OmegaConf.structured(schema.ModelCard), card),
        "recipe": OmegaConf.merge(OmegaConf.structured(schema.RecipeConfig),
                                  OmegaConf.load(os.path.join(RECIPES_DIR, f"{recipe}.yaml"))),
        "executor": OmegaConf.structured(schema.LocalExecutorConfig),
        "stages": {
            "quantize": {"enabled": quantize, "parallel": quantize_parallel or {"ep": 4, "world_size": 4},
                         "calib": {"dataset": calib, "size": 8, "max_seq_len": 32, "batch_size": 4}},
            "mmlu": {"enabled": False, "dataset": "unused"},
            "export": {"parallel": export_parallel or {"pp": 4, "world_size": 4}, "verify_samples": 4},
        },
    })
    return OmegaConf.to_yaml(cfg, resolve=True)


# key -> (recipe, stages.quantize.enabled, format for a deliberately failing re-export)
RUNS = {"nvfp4": ("nvfp4_default", True, "fp8"), "fp8": ("fp8_default", True, None),
        "none": ("none", True, None), "none_hf": ("none", False, None)}


@pytest.fixture(scope="module")
def pipelines(source, tmp_path_factory):
    """One 4-rank launch: NVFP4 and none (quantize at EP4 -> export at PP4), and none exported
    straight from the HF weights (stages.quantize disabled)."""
    src, calib = source
    root = tmp_path_factory.mktemp("export_stage")
    runs = {key: (_config(src, calib, recipe, str(root), quantize), str(root / key), wrong)
            for key, (recipe, quantize, wrong) in RUNS.items()}
    [rank0, *_] = run_on_ranks("test_export_stage:pipelines_worker", nprocs=4,
                               kwargs={"runs": list(runs.values())}, timeout_s=560)
    return {key: (run_dir, rank0[run_dir]) for key, (_, run_dir, _) in runs.items()}


def _assert_published(run_dir: str, res: dict) -> dict:
    final = os.path.join(run_dir, "export", "hf")
    report = res["report"]
    assert report["ok"] is True, report["errors"]
    assert report["export_dir"] == final
    assert res["export_listing"] == ["hf", "verify.json"]  # no tmp, no rejected
    modes = res["file_modes"]
    assert not [n for n in modes if n.startswith("model-") and n.endswith(".json")]  # no sidecars
    assert "model.safetensors.index.json" in modes and "config.json" in modes
    umask = os.umask(0)
    os.umask(umask)
    assert set(modes.values()) == {0o666 & ~umask}, modes  # safetensors' 0600 shards made readable
    assert report["layout"]["pp"] == 4 and report["layout"]["ep"] == 1
    assert res["second_export"].startswith(f"{final} exists; refusing to overwrite it")
    return report


def test_nvfp4_saved_at_ep4_exported_at_pp4_verifies(pipelines):
    run_dir, res = pipelines["nvfp4"]
    report = _assert_published(run_dir, res)
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


def test_fp8_saved_at_ep4_exported_at_pp4_verifies(pipelines):
    run_dir, res = pipelines["fp8"]
    report = _assert_published(run_dir, res)
    assert report["quant_algo"] == "FP8" and report["checks"]["modules"]["quantized"] == 4 * (4 + 8 * 3)
    assert report["checks"]["dequant_vs_source"]["by_kind"]["expert"]["max_rel_err"] < 0.05
    mega = report["checks"]["dequant_vs_megatron"]["by_kind"]
    assert set(mega) == {"attention", "expert"}
    # measured: multiply-vs-divide by the scale leaves ~1 fp32 ulp on most elements, no rounding flips
    assert all(k["modules"] >= 4 and k["flips"] == 0 and k["max_abs_diff"] < 1e-6 for k in mega.values()), mega


@pytest.mark.parametrize("key", ["none", "none_hf"])
def test_recipe_none_round_trip_is_bit_exact(pipelines, key):
    run_dir, res = pipelines[key]
    report = _assert_published(run_dir, res)
    assert ("'ep': 4" in report["loaded_from"]) if key == "none" else ("stages.quantize disabled" in report["loaded_from"])
    assert report["quant_algo"] is None
    rt = report["checks"]["roundtrip"]
    assert rt["compared"] == report["checks"]["names_vs_source"]["source_tensors"] == rt["bit_exact"]
    assert report["checks"]["modules"]["quantized"] == 0
    mega = report["checks"]["dequant_vs_megatron"]["by_kind"]
    assert all(k["bit_exact"] == k["modules"] for k in mega.values()), mega
    assert not os.path.exists(os.path.join(run_dir, "export", "hf", "hf_quant_config.json"))


def test_failed_verification_fails_the_stage_and_rejects_the_export(pipelines):
    """Re-export (overwrite=true) checked against the wrong recipe format: the stage fails with
    verify's message, the export is kept as hf.rejected, and the replaced export is gone (the
    invariant: export/<name> exists only next to a verify.json that passed for it)."""
    run_dir, res = pipelines["nvfp4"]
    export_dir = os.path.join(run_dir, "export")
    msg = res["wrong_format_export"]
    assert msg.startswith("export verification failed, "), msg
    assert "hf_quant_config.json quantization.quant_algo='NVFP4', expected FP8 for recipe format fp8" in msg
    assert f"Rejected export kept at {export_dir}/hf.rejected; details in {export_dir}/verify.json" in msg
    assert res["after_failure"] == ["hf.rejected", "verify.json"]
    report = res["wrong_format_report"]
    assert report["ok"] is False and report["export_dir"] == os.path.join(export_dir, "hf.rejected")
    assert "model.layers.0.self_attn.q_proj.weight has dtype uint8, expected float8_e4m3fn" in report["errors"]


@pytest.mark.gpu
def test_gpu_quantize_then_export_verifies(source, tmp_path):
    """On one GPU (bf16 model, ModelOpt's CUDA fake-quant kernels): NVFP4 and FP8 exports verify
    against the model's fake-quantized weights within the stated tolerance; the counts of
    elements that are not bit-identical are printed (and written to $GPU_REPORT_DIR)."""
    if not pytest.importorskip("torch").cuda.is_available():   # checked here, not at import: collecting stays torch-free
        pytest.skip("needs an NVIDIA GPU")
    src, calib = source
    one = {"world_size": 1}
    runs = [(_config(src, calib, recipe, str(tmp_path), True, one, one), str(tmp_path / recipe), None)
            for recipe in ("nvfp4_default", "fp8_default", "none")]
    [rank0] = run_on_ranks("test_export_stage:pipelines_worker", nprocs=1, timeout_s=580,
                           kwargs={"runs": runs, "device": "cuda"},
                           env={"CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0")})
    summary = {os.path.basename(r): {"ok": res["report"]["ok"], "errors": res["report"]["errors"][:5],
                                     "warnings": res["report"]["warnings"],
                                     "dequant_vs_megatron": res["report"]["checks"].get("dequant_vs_megatron"),
                                     "dequant_vs_source": res["report"]["checks"].get("dequant_vs_source"),
                                     "roundtrip": res["report"]["checks"].get("roundtrip"),
                                     "size": res["report"]["size"]}
               for r, res in rank0.items()}
    print(json.dumps(summary, indent=1))
    if os.environ.get("GPU_REPORT_DIR"):
        os.makedirs(os.environ["GPU_REPORT_DIR"], exist_ok=True)
        with open(os.path.join(os.environ["GPU_REPORT_DIR"], "export_gpu.json"), "w") as f:
            json.dump(summary, f, indent=1)
    for name, s in summary.items():
        assert s["ok"], (name, s["errors"])
