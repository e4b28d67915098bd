"""Quantize stage: HF checkpoint -> Megatron model -> calibrate + mtq.quantize -> checks -> checkpoint.

Outputs (under ``<run>/quantize/``): ``summary.json`` (rank 0; quantizers per format and module
kind, check results, calibration facts, package versions) and ``checkpoint/`` (Megatron dist
checkpoint + ModelOpt state, renamed into place only when complete).  Recipe ``none`` skips
calibration and quantization and saves the imported weights.  Fails with ``StageFailed`` when
the recipe should quantize and nothing is enabled, or when an expert linear stays unquantized.
"""
from __future__ import annotations

from importlib import metadata

from launcher.contract import StageFailed, write_json_atomic
from launcher.megatron.collectives import all_gather
from launcher.stages.context import StageContext
from launcher.stages.timings import Timings

PACKAGES = ("torch", "megatron-core", "nvidia-modelopt", "transformers", "safetensors", "datasets",
            "transformer-engine", "mamba-ssm")


def package_versions() -> dict[str, str | None]:
    out = {}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def _same_on_all_ranks(value: int, what: str) -> None:
    """Fail on every rank (not hang in a later collective) when ranks disagree on ``value``."""
    values = all_gather(value)
    if len(set(values)) != 1:
        raise StageFailed(f"ranks disagree on {what}: {values}; calibration forwards are collectives "
                          "and every rank must make the same number of them")


def _relative_error(quantized, reference) -> float | None:
    """||q - ref|| / ||ref|| over the last pipeline stage's logits, gathered to every rank."""
    local = None
    if quantized is not None and reference is not None:
        local = float((quantized - reference).norm() / reference.norm().clamp_min(1e-12))
    found = [v for v in all_gather(local) if v is not None]
    return max(found) if found else None


def _calibrate(ctx: StageContext, model, quant_cfg, timings: Timings) -> tuple[dict, float | None]:
    """Calibrate and quantize ``model`` in place; (calibration facts, logits relative error on batch 0)."""
    import modelopt.torch.quantization as mtq

    from launcher.megatron.forward import forward_logits
    from launcher.megatron.models import unwrap_model
    from launcher.quant.calibration import calibration_batches
    from launcher.quant.recipes import calibration_algorithm

    cfg, stage = ctx.cfg, ctx.stage_cfg
    with timings.measure("calibrate_and_quantize_s"):
        batches = calibration_batches(stage.calib, cfg.model.path, cfg.model.trust_remote_code)
        _same_on_all_ranks(len(batches), "the number of calibration batches")
        facts = dict(dataset=stage.calib.dataset, batches=len(batches),
                     samples=sum(int(b.shape[0]) for b in batches), seq_len=int(batches[0].shape[1]),
                     batch_size=stage.calib.batch_size, algorithm=calibration_algorithm(quant_cfg))
        reference = forward_logits(model, batches[0])

        def forward_loop(_inner_model):
            for i, batch in enumerate(batches):
                forward_logits(model, batch)  # through the wrapper: dtype casts, pipeline schedule
                if (i + 1) % max(1, len(batches) // 4) == 0:
                    ctx.log(f"calibration batch {i + 1}/{len(batches)}")

        inner = unwrap_model(model)
        quantized_inner = mtq.quantize(inner, quant_cfg, forward_loop)
        assert quantized_inner is inner, "mtq.quantize must convert the model in place"
    relative_error = _relative_error(forward_logits(model, batches[0]), reference)
    ctx.log(f"quantized in {timings['calibrate_and_quantize_s']} s; logits relative error on "
            f"calibration batch 0: {relative_error}")
    return facts, relative_error


def _report(ctx: StageContext, quantized: bool, calibration: dict, relative_error, summary: dict,
            problems: list[str], timings: Timings) -> dict:
    """The content of quantize/summary.json."""
    recipe = ctx.cfg.recipe
    return {
        "recipe": {"name": recipe.name, "format": recipe.format, "modelopt_cfg": recipe.modelopt_cfg,
                   "recipe_path": recipe.recipe_path, "exclude_modules": list(recipe.exclude_modules),
                   "quantize_experts": bool(recipe.quantize_experts)},
        "model": {"path": ctx.cfg.model.path, "architecture": ctx.cfg.model.architecture},
        "layout": ctx.dims.describe(),
        "device": ctx.device,
        "quantized": quantized,
        "calibration": calibration,
        "logits_relative_error_calib_batch0": relative_error,
        "summary": summary,
        "checks": {"passed": not problems, "problems": problems},
        "timings": timings,
        "versions": package_versions(),
    }


def _log_summary(ctx: StageContext, summary: dict) -> None:
    ctx.log(f"quantizers enabled {summary['quantizers_enabled']}/{summary['quantizers_total']} "
            f"{summary['enabled_by_format']}; expert linears weight-quantized "
            f"{summary['expert_linears_weight_quantized']}/{summary['expert_linears']}")
    for kind, names in summary["weight_quantized_by_name"].items():
        ctx.log(f"  {kind}: " + ", ".join(f"{n} {q}/{t}" for n, (q, t) in names.items()))


def run(ctx: StageContext) -> None:
    from launcher.megatron.checkpoint import save_checkpoint
    from launcher.megatron.hf_io import import_hf_weights
    from launcher.megatron.models import build_model, unwrap_model
    from launcher.quant.recipes import check_recipe_layout, resolve_quant_cfg
    from launcher.quant.summary import check_summary, gather_summary

    cfg, stage = ctx.cfg, ctx.stage_cfg
    recipe = cfg.recipe
    timings = Timings()
    quant_cfg = resolve_quant_cfg(recipe)
    check_recipe_layout(quant_cfg, ctx.dims.ep, recipe.name)
    should_quantize = quant_cfg is not None
    ctx.log(f"recipe {recipe.name} (format {recipe.format}); layout {ctx.dims.describe()} on {ctx.device}")

    with timings.measure("build_and_import_s"):
        model = build_model(cfg.model.path, ctx.dims, ctx.device, stage.dtype, stage.moe_dispatcher,
                            cfg.model.trust_remote_code)
        import_hf_weights(model, cfg.model.path, stage.dtype)
    ctx.log(f"built {type(unwrap_model(model)).__name__} and imported {cfg.model.path} "
            f"in {timings['build_and_import_s']} s")

    calib_facts, relative_error = {"dataset": stage.calib.dataset}, None
    if should_quantize:
        calib_facts, relative_error = _calibrate(ctx, model, quant_cfg, timings)
    else:
        ctx.log("recipe format 'none': no calibration, no quantization")

    summary = gather_summary(model)
    problems = check_summary(summary, should_quantize, bool(recipe.quantize_experts))
    report = _report(ctx, should_quantize, calib_facts, relative_error, summary, problems, timings)
    if ctx.rank == 0:
        write_json_atomic(ctx.layout.quantize_summary, report)
    _log_summary(ctx, summary)
    if problems:
        raise StageFailed("quantize checks failed: " + "; ".join(problems))

    with timings.measure("save_checkpoint_s"):
        save_checkpoint(model, ctx.layout.quantize_checkpoint, overwrite=True)
    ctx.log(f"saved checkpoint {ctx.layout.quantize_checkpoint} in {timings['save_checkpoint_s']} s")
