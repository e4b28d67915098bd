"""Export stage: quantize/checkpoint -> HF unified checkpoint at export/<name>, verified.

Every rank builds its PP stage at the export degrees (config validation guarantees tp=1, ep=1:
ModelOpt's export corrupts otherwise), loads ``<run>/quantize/checkpoint`` (ModelOpt state +
weights, saved at any layout) - or imports the HF weights when stages.quantize is disabled -
and ModelOpt writes the checkpoint into ``export/<name>.tmp-export``.  Every rank then compares
the exported weights of its sampled linears with the fake-quantized weights of its in-memory
model; rank 0 runs ``launcher.export.verify.verify_export`` over the whole directory.  Only a
verified export is renamed to ``export/<name>``; a failed one is kept as ``<name>.rejected`` for
inspection, verify.json says why, and the stage fails on every rank with the first problems.
An existing export/<name> is never replaced unless stages.export.overwrite is true (then it is
removed even when the new export fails: export/<name> only ever sits next to a passing verify.json).
"""
from __future__ import annotations

import os
import shutil
import time

from launcher.contract import StageFailed, write_json_atomic
from launcher.megatron.collectives import all_gather, broadcast, on_rank0
from launcher.stages.context import StageContext
from launcher.stages.timings import Timings

TMP_SUFFIX = ".tmp-export"
REJECTED_SUFFIX = ".rejected"
MAX_ERRORS_IN_MESSAGE = 5
# Rank 0 verifies alone (a recipe-none round trip reads every tensor twice: minutes for a 100B
# model) while the others wait; they wait on a gloo group of their own with this timeout, not on
# the stage's collective timeout (120 s by default).
VERIFY_WAIT_TIMEOUT_S = 6 * 3600


def _references(ctx: StageContext, model, fmt: str, export_dir: str):
    """(this rank's dequant-vs-Megatron results, HF names of modules it quantized), or
    (None, reason) when the model's layout has no HF name mapping."""
    from megatron.core import parallel_state as ps

    from launcher.export.megatron_ref import (
        fake_quantized_references, linear_modules, quantized_hf_modules, select_samples)
    from launcher.export.verify_values import compare_references

    try:
        linears = linear_modules(model)
    except ValueError as e:
        return None, f"dequantized weights not compared with the Megatron model: {e}"
    quantized = quantized_hf_modules(model)
    if ps.get_data_parallel_rank() != 0:  # DP replicas hold the same layers: one compares
        return [], quantized
    card = ctx.cfg.model
    chosen = select_samples(linears, int(ctx.stage_cfg.verify_samples), int(card.num_layers),
                            int(card.num_experts or 0), card.hybrid_pattern)
    try:
        return compare_references(export_dir, fake_quantized_references(chosen), fmt), quantized
    except Exception as e:  # noqa: BLE001 - becomes a verification error, not a hang
        return [{"module": f"rank {ctx.rank} references", "kind": "error",
                 "error": f"rank {ctx.rank}: comparing with the Megatron model failed: {type(e).__name__}: {e}"}], quantized


def _load_weights(ctx: StageContext, model) -> str:
    from launcher.megatron.checkpoint import load_checkpoint
    from launcher.megatron.hf_io import import_hf_weights

    cfg = ctx.cfg
    if cfg.stages.quantize.enabled:
        path = ctx.layout.quantize_checkpoint
        if not os.path.isdir(path):
            raise StageFailed(f"{path} does not exist: run stages.quantize first (or disable it to export "
                              f"the HF weights with recipe none)")
        marker = load_checkpoint(model, path)
        return f"quantize checkpoint {path} (saved at {marker.get('saved_at_layout')})"
    import_hf_weights(model, cfg.model.path, ctx.stage_cfg.dtype)
    return f"HF weights {cfg.model.path} (stages.quantize disabled)"


def _verify(ctx: StageContext, tmp: str, fmt: str, expected_dtype: str, results: list, quantized: set) -> dict:
    from launcher.export.verify import verify_export

    cfg = ctx.cfg
    return verify_export(
        tmp, fmt, source_dir=cfg.model.path, num_layers=int(cfg.model.num_layers),
        num_experts=int(cfg.model.num_experts or 0), expected_dtype=expected_dtype,
        quantized_modules=quantized, quantize_experts=bool(cfg.recipe.quantize_experts) and fmt != "none",
        reference_results=results, samples=int(ctx.stage_cfg.verify_samples))


def _readable_by_umask(directory: str) -> None:
    """safetensors writes shards as 0600; give every file the mode the process umask allows, so a
    server running as another user (vLLM on a shared cluster) can read the checkpoint."""
    umask = os.umask(0)
    os.umask(umask)
    for name in os.listdir(directory):
        os.chmod(os.path.join(directory, name), 0o666 & ~umask)


def _publish(tmp: str, final: str, ok: bool, overwrite: bool) -> str:
    """Rename ``tmp`` to ``final`` (verified) or ``final.rejected``.  Invariant: export/<name>
    exists only next to a verify.json that passed for it, so a failed re-export with overwrite
    also removes the export it was asked to replace."""
    _readable_by_umask(tmp)
    target = final if ok else final + REJECTED_SUFFIX
    if os.path.exists(final) and (ok or overwrite):
        if not overwrite:
            raise StageFailed(f"{final} appeared during the export; refusing to overwrite it")
        shutil.rmtree(final)
    if os.path.exists(target):
        shutil.rmtree(target)
    os.replace(tmp, target)
    return target


def _start(ctx: StageContext, final: str, tmp: str) -> None:
    """Refuse an existing export unless overwrite is set; make an empty ``tmp`` (rank 0)."""
    if ctx.dims.tp != 1 or ctx.dims.ep != 1 or ctx.dims.etp != 1:
        raise StageFailed(f"export needs tp=1 ep=1 etp=1, got {ctx.dims.describe()} (config validation refuses this)")
    exists = broadcast(os.path.exists(final) if ctx.rank == 0 else None)
    if exists and not ctx.stage_cfg.overwrite:
        raise StageFailed(f"{final} exists; refusing to overwrite it (set stages.export.overwrite=true)")
    _, err = on_rank0(lambda: (shutil.rmtree(tmp, ignore_errors=True), os.makedirs(tmp)), ctx.rank)
    if err:
        raise StageFailed(f"cannot create {tmp}: {err}")


def _all_references(ctx: StageContext, model, fmt: str, tmp: str):
    """Every rank's dequant-vs-Megatron results and quantized HF module names, on every rank:
    (results, names, []) or (None, None, why not, per rank whose layout has no HF name mapping)."""
    results, quantized = _references(ctx, model, fmt, tmp)
    gathered = all_gather((results, sorted(quantized) if results is not None else quantized))
    unmapped = sorted({names for rank_results, names in gathered if rank_results is None})
    if unmapped:
        return None, None, unmapped
    return [r for rank_results, _ in gathered for r in rank_results], {n for _, names in gathered for n in names}, []


def _raise_if_rejected(ctx: StageContext, summary: dict) -> None:
    if summary["ok"]:
        return
    errors = summary["errors"]
    more = f" (and {len(errors) - MAX_ERRORS_IN_MESSAGE} more)" if len(errors) > MAX_ERRORS_IN_MESSAGE else ""
    raise StageFailed(f"export verification failed, {len(errors)} problem(s): "
                      + "; ".join(errors[:MAX_ERRORS_IN_MESSAGE]) + more
                      + f". Rejected export kept at {summary['export_dir']}; details in "
                      + ctx.layout.export_verify)


def _publish_unverified(ctx: StageContext, tmp: str, final: str, timings: Timings) -> None:
    ctx.warn("stages.export.verify=false: publishing an UNVERIFIED export")
    _, err = on_rank0(lambda: (_publish(tmp, final, True, ctx.stage_cfg.overwrite), write_json_atomic(
        ctx.layout.export_verify, {"ok": None, "skipped": "stages.export.verify=false",
                                   "export_dir": final, "timings": timings})), ctx.rank)
    if err:
        raise StageFailed(err)


def run(ctx: StageContext) -> None:
    from launcher.megatron.hf_io import export_hf
    from launcher.megatron.models import build_model, resolve_dtype

    cfg, stage = ctx.cfg, ctx.stage_cfg
    fmt = str(cfg.recipe.format)
    final = ctx.layout.export_dir(stage.name)
    tmp = final + TMP_SUFFIX
    _start(ctx, final, tmp)
    timings = Timings()
    with timings.measure("build_and_load_s"):
        model = build_model(cfg.model.path, ctx.dims, ctx.device, stage.dtype, "alltoall", cfg.model.trust_remote_code)
        loaded_from = _load_weights(ctx, model)
    ctx.log(f"loaded {loaded_from} at {ctx.dims.describe()} in {timings['build_and_load_s']} s")
    with timings.measure("export_s"):
        try:
            export_hf(model, cfg.model.path, tmp, stage.dtype)
        except RuntimeError as e:  # ModelOpt's own self-check ("Export dropped N tensor(s) ...")
            raise StageFailed(f"ModelOpt export failed: {e}") from e
    ctx.log(f"ModelOpt wrote {tmp} in {timings['export_s']} s")

    if not stage.verify:
        _publish_unverified(ctx, tmp, final, timings)
        return

    t = time.time()
    expected_dtype = str(resolve_dtype(stage.dtype, ctx.device)).replace("torch.", "")
    all_results, all_quantized, unmapped = _all_references(ctx, model, fmt, tmp)

    def verify_and_publish():
        try:
            report = _verify(ctx, tmp, fmt, expected_dtype, all_results, all_quantized)
            report["warnings"] = list(unmapped) + report["warnings"]
        except Exception as e:  # noqa: BLE001 - a verifier crash is a failed verification
            report = {"ok": False, "errors": [f"verification crashed: {type(e).__name__}: {e}"]}
        timings.since("verify_s", t)
        report.update(loaded_from=loaded_from, layout=ctx.dims.describe(), recipe=cfg.recipe.name,
                      timings=timings)
        report["export_dir"] = _publish(tmp, final, bool(report["ok"]), bool(stage.overwrite))
        write_json_atomic(ctx.layout.export_verify, report)
        return {"ok": report["ok"], "errors": report["errors"], "export_dir": report["export_dir"],
                "size": report.get("size")}

    summary, err = on_rank0(verify_and_publish, ctx.rank, wait_s=VERIFY_WAIT_TIMEOUT_S)
    if err:
        raise StageFailed(f"export verification could not complete: {err}")
    _raise_if_rejected(ctx, summary)
    size = summary.get("size") or {}
    ctx.log(f"verified {summary['export_dir']}: {size.get('export_bytes')} bytes = "
            f"{size.get('ratio_vs_bf16')} x bf16")
