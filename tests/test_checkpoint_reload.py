"""NVFP4-quantized dist checkpoint saved at EP4, reloaded at EP4, EP1 and PP4 (4 gloo ranks).

The reloaded model must give the logits the quantized model gave before saving (fp32;
tolerance RELOAD_TOLERANCE), keep every quantizer enabled, and differ from the unquantized
model (so the ModelOpt state really was restored, not just the weights).
"""
from __future__ import annotations

import json
import os

import pytest

from launcher_testing.ranks import REPO_ROOT, run_on_ranks

RELOAD_TOLERANCE = 1e-5   # max |logits(reloaded) - logits(before save)|, fp32


def save_and_reload_worker(hf_path: str, ckpt: str, reload_layouts: list[dict], export_dir: str) -> dict:
    import torch
    from omegaconf import OmegaConf

    import modelopt.torch.quantization as mtq
    from launcher.schema import RecipeConfig
    from launcher.megatron.checkpoint import load_checkpoint, save_checkpoint
    from launcher.megatron.dist import init_distributed, shutdown
    from launcher.megatron.forward import forward_logits
    from launcher.megatron.hf_io import export_hf, import_hf_weights
    from launcher.megatron.models import build_model, unwrap_model
    from launcher.quant.recipes import resolve_quant_cfg
    from launcher.quant.summary import gather_summary
    from launcher.topology import ParallelDims

    world = int(os.environ["WORLD_SIZE"])
    gen = torch.Generator().manual_seed(11)
    calib = [torch.randint(0, 256, (2, 16), generator=gen) for _ in range(3)]
    tokens = torch.randint(0, 256, (2, 12), generator=gen)
    recipe = OmegaConf.merge(OmegaConf.structured(RecipeConfig),
                             OmegaConf.load(os.path.join(REPO_ROOT, "recipes", "nvfp4_default.yaml")))

    dims = ParallelDims(world_size=world, ep=4)
    init_distributed(dims, "cpu", timeout_s=90, seed=1234)
    model = build_model(hf_path, dims, "cpu", "float32", "alltoall")
    import_hf_weights(model, hf_path, "float32")
    unquantized = forward_logits(model, tokens)
    mtq.quantize(unwrap_model(model), resolve_quant_cfg(recipe), lambda _: [forward_logits(model, b) for b in calib])
    reference = forward_logits(model, tokens)
    enabled_before = gather_summary(model)["quantizers_enabled"]
    save_checkpoint(model, ckpt)
    try:
        save_checkpoint(model, ckpt)
        refused_overwrite = False
    except ValueError:
        refused_overwrite = True
    out = {"quantization_changed_logits": float((reference - unquantized).abs().max()),
           "refused_overwrite": refused_overwrite, "enabled_before": enabled_before,
           "leftovers": sorted(n for n in os.listdir(os.path.dirname(ckpt)) if ".tmp" in n)}

    for layout in reload_layouts:
        dims = ParallelDims(world_size=world, **layout)
        init_distributed(dims, "cpu", timeout_s=90, seed=4321)   # other seed: weights must come from disk
        fresh = build_model(hf_path, dims, "cpu", "float32", "alltoall")
        marker = load_checkpoint(fresh, ckpt)
        logits = forward_logits(fresh, tokens)
        key = "_".join(f"{k}{v}" for k, v in layout.items())
        out[key] = {"max_abs_diff": None if logits is None else float((logits - reference).abs().max()),
                    "enabled": gather_summary(fresh)["quantizers_enabled"],
                    "saved_at_ep": marker["saved_at_layout"]["ep"]}
        if layout == {"pp": 4}:   # tp=1, ep=1, dp=1: the layout export supports
            out["export_files"] = export_hf(fresh, hf_path, export_dir, "float32")
    shutdown()
    return out


@pytest.mark.slow
def test_nvfp4_checkpoint_reloads_at_ep4_ep1_pp4(random_tiny_moe, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    results = run_on_ranks("test_checkpoint_reload:save_and_reload_worker", nprocs=4, timeout_s=360,
                           kwargs={"hf_path": random_tiny_moe, "ckpt": ckpt,
                                   "reload_layouts": [{"ep": 4}, {"ep": 1}, {"pp": 4}],
                                   "export_dir": str(tmp_path / "export")})
    print({k: v for k, v in results[-1].items()})
    for rank, r in enumerate(results):
        assert r["quantization_changed_logits"] > 1e-3, "NVFP4 must change the logits"
        assert r["refused_overwrite"] and r["leftovers"] == []
        for key in ("ep4", "ep1", "pp4"):
            assert r[key]["enabled"] == r["enabled_before"] > 0, (rank, key, r)
            assert r[key]["saved_at_ep"] == 4
        for key in ("ep4", "ep1"):
            assert r[key]["max_abs_diff"] < RELOAD_TOLERANCE, (rank, key, r[key])
    pp4 = [r["pp4"]["max_abs_diff"] for r in results]
    assert pp4[:3] == [None, None, None] and pp4[3] < RELOAD_TOLERANCE, pp4
    assert sorted(os.listdir(ckpt)).count("modelopt_state") == 1

    # export after reload (PP4, EP1): no ModelOpt sidecar .json files, tokenizer copied, NVFP4 config
    files = results[0]["export_files"]
    assert not [f for f in files if f.startswith("model-") and f.endswith(".json")], files
    for name in ("config.json", "hf_quant_config.json", "model.safetensors.index.json", "tokenizer.json",
                 "tokenizer_config.json"):
        assert name in files, (name, files)
    quant = json.load(open(tmp_path / "export" / "hf_quant_config.json"))["quantization"]
    assert quant["quant_algo"] == "NVFP4" and quant["group_size"] == 16
