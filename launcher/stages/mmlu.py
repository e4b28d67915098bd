"""Stage ``mmlu``: evaluate the quantized checkpoint on MMLU and gate the pipeline on it.

Every rank: load the questions from exactly ``stages.mmlu.dataset`` (few-shot examples from its
dev split or ``dev_dataset``), select ``fraction`` per subject, render lm-eval prompts, tokenize
with the checkpoint's tokenizer, batch, plan the shards (``shard_mode``), build the model at the
stage's degrees and load ``quantize/checkpoint`` (or import the HF weights when quantize is
disabled), run the plan under the desync guard.  ``baseline=evaluate`` first evaluates the
unquantized HF weights on the same questions in the same model (the checkpoint is loaded after),
unless launcher/mmlu/baseline_cache.py holds them for this checkpoint and these prompts;
``baseline=cached`` takes them from there only.  The drop is then paired (launcher/mmlu/paired.py).
Rank 0 gathers, decides the gate, writes ``mmlu/results.json`` atomically and broadcasts the
decision; on "fail" every rank raises ``StageFailed(exit_code=ExitCode.GATE_FAILED)``.
"""
from __future__ import annotations

import time
from typing import Optional

from launcher.contract import ExitCode, StageFailed, write_json_atomic
from launcher.megatron.collectives import LONG_WAIT_S, broadcast, on_rank0
from launcher.mmlu import gate as gate_mod
from launcher.mmlu.batching import padding_efficiency
from launcher.mmlu.prepared import Prepared, load_tokenizer, prepare
from launcher.mmlu.results import Evaluation, build_results, decide
from launcher.schema import gate_dtype
from launcher.stages.context import StageContext
from launcher.stages.timings import Timings


def _baseline_lookup(ctx: StageContext, prepared: Prepared, dtype: str) -> dict:
    """Rank 0 looks the baseline up in the cache (launcher/mmlu/baseline_cache.py); every rank
    learns hit or miss.  baseline=cached fails on every rank on a miss, before any forward."""
    from launcher.megatron.models import resolve_dtype
    from launcher.mmlu import baseline_cache

    scfg = ctx.stage_cfg
    found = None

    def lookup() -> dict:
        nonlocal found
        t = time.time()
        found = baseline_cache.lookup(
            baseline_cache.resolve_dir(scfg.baseline_cache_dir), ctx.cfg.model.path,
            [p.text for p in prepared.prompts], prepared.token_ids, scfg.few_shots, scfg.add_bos,
            str(resolve_dtype(dtype, ctx.device)).replace("torch.", ""))
        return {"hit": found.hit, "path": found.path, "key": found.key, "miss": found.miss_reason,
                "seconds": round(time.time() - t, 2)}

    # rank 0 may hash a large checkpoint for minutes the first time: the others wait that long
    info, error = on_rank0(lookup, ctx.rank, wait_s=LONG_WAIT_S, errors=(OSError, ValueError))
    if error:
        raise StageFailed(f"baseline cache: {error}")
    if scfg.baseline == "cached" and not info["hit"]:
        raise StageFailed(f"stages.mmlu.baseline='cached': {info['miss']}")
    ctx.log(f"baseline cache {'hit' if info['hit'] else 'miss'}: {info['path']}"
            + (f" (key computed in {info['seconds']} s)" if ctx.rank == 0 else ""))
    info["source"] = "cache" if info["hit"] else "evaluated"
    info["lookup"] = found
    return info


def _baseline_from_cache(ctx: StageContext, cached: dict, evaluated: Optional[dict], prepared: Prepared):
    """Rank 0: the cached baseline on a hit; on a miss store the evaluated one and return it."""
    from launcher.mmlu import baseline_cache

    found = cached["lookup"]
    if found.hit:
        return found.results
    acc = Evaluation.of(evaluated).correct([p.question.answer for p in prepared.prompts]) / len(prepared.prompts)
    path = baseline_cache.store(found, evaluated, ctx.cfg.model.path, acc, ctx.dims.describe())
    ctx.log(f"baseline results cached at {path}")
    return evaluated


def _prepare(ctx: StageContext) -> Prepared:
    """The questions, tokenized and batched for this device (every rank the same)."""
    from launcher.mmlu.evaluate import batch_limits
    from launcher.paths import cache_dir

    scfg, cfg = ctx.stage_cfg, ctx.cfg
    tokenizer = load_tokenizer(cfg.model.path, bool(cfg.model.trust_remote_code))
    return prepare(scfg, tokenizer, batch_limits(scfg, ctx.device, cfg.model.path), cache_dir())


def _log_prepared(ctx: StageContext, prepared: Prepared) -> None:
    scfg = ctx.stage_cfg
    if prepared.token_cache.get("error"):
        ctx.warn(prepared.token_cache["error"])
    if prepared.truncated:
        ctx.warn(f"{prepared.truncated} prompt(s) longer than stages.mmlu.max_seq_len="
                 f"{scfg.max_seq_len} were left-truncated (the question end is kept)")
    ctx.log(f"{len(prepared.prompts)} questions, {len(prepared.batches)} batches ({prepared.limits.summary()}), "
            f"padding efficiency {padding_efficiency(prepared.batches):.3f}, shard_mode={scfg.shard_mode}, "
            f"token cache {prepared.token_cache.get('cache')}")


def _evaluate(ctx: StageContext, prepared: Prepared, timings: Timings):
    """Build the model, evaluate the baseline when it is evaluated here, load the quantized checkpoint
    and evaluate it: (results and baseline on rank 0, the shard plan, the cache lookup or None)."""
    from launcher.megatron.checkpoint import load_checkpoint
    from launcher.megatron.hf_io import import_hf_weights
    from launcher.megatron.models import build_model, resolve_dtype
    from launcher.mmlu.evaluate import evaluate_model, prepare_model_for_eval, release_model_after_eval

    scfg, cfg = ctx.stage_cfg, ctx.cfg
    quantized = bool(cfg.stages.quantize.enabled)
    dtype = gate_dtype(cfg)   # the one rule: the quantize stage's dtype (launcher.schema)
    with timings.measure("build_s"):
        cached = _baseline_lookup(ctx, prepared, dtype) if scfg.baseline in gate_mod.PER_QUESTION_BASELINES else None
        model = build_model(cfg.model.path, ctx.dims, ctx.device, dtype, scfg.moe_dispatcher,
                            bool(cfg.model.trust_remote_code), eval_kernels=ctx.device == "cuda")
        evaluate_base = scfg.baseline == "evaluate" and not cached["hit"]
        if not quantized or evaluate_base:
            import_hf_weights(model, cfg.model.path, dtype)
    common = dict(dims=ctx.dims, rank=ctx.rank, mode=scfg.shard_mode, dispatcher=scfg.moe_dispatcher,
                  timeout_s=float(scfg.collective_timeout_s),
                  allow_unsafe=bool(scfg.allow_unsafe_shard_mode), stage=ctx.name, log=ctx.log,
                  groups_cache={})
    baseline = None
    if evaluate_base and quantized:
        with timings.measure("baseline_eval_s"):
            prepare_model_for_eval(model, ctx.log)
            baseline, _, _ = evaluate_model(model, prepared, label="baseline", **common)
            release_model_after_eval(model)
    if quantized:
        with timings.measure("load_checkpoint_s"):
            load_checkpoint(model, ctx.layout.quantize_checkpoint)
    # the folded weights are the exported ones (launcher.megatron.fold), in the export's dtype
    export = cfg.stages.get("export")   # a gate-only config (tests) may have no export stage
    export_dtype = resolve_dtype(export.dtype, ctx.device) if export is not None and export.enabled else None
    timings["fold_and_group_s"] = prepare_model_for_eval(model, ctx.log, export_dtype)["seconds"]
    with timings.measure("eval_s"):
        results, plan, local = evaluate_model(model, prepared, label="quantized" if quantized else "", **common)
    timings["forward_calls_this_rank"] = local.forward_calls
    if evaluate_base and not quantized:
        ctx.warn("baseline=evaluate with quantize disabled: the evaluated model is the baseline")
        baseline = results
    if cached is not None and ctx.rank == 0:
        baseline = _baseline_from_cache(ctx, cached, baseline, prepared)
    return results, baseline, plan, cached


def _decide_and_write(ctx: StageContext, prepared: Prepared, results, baseline, plan, cached,
                      timings: Timings) -> dict:
    """Rank 0: the gate's decision, written to mmlu/results.json and logged; the verdict to broadcast."""
    scfg = ctx.stage_cfg
    decision = decide(prepared, results, scfg, baseline)
    timings.total("total_s")
    doc = build_results(prepared, results, scfg, decision, plan, baseline, timings)
    if cached is not None:
        doc["baseline"].update(source=cached["source"], cache=cached["path"], cache_key=cached["key"])
    write_json_atomic(ctx.layout.mmlu_results, doc)
    ctx.log("per-subject accuracy:\n" + gate_mod.format_table(doc["per_subject"]))
    lo, hi = decision.interval
    ctx.log(f"accuracy {decision.accuracy:.4f} ({decision.correct}/{decision.n}), 95% interval "
            f"[{lo:.4f}, {hi:.4f}], lower_bound {scfg.lower_bound}, baseline "
            f"{decision.baseline_accuracy}, agreement {decision.agreement}: "
            f"{'PASS' if decision.passed else 'FAIL'}")
    for w in decision.warnings:
        ctx.warn(w)
    return {"pass": decision.passed, "failures": decision.failures}


def run(ctx: StageContext) -> None:
    scfg = ctx.stage_cfg
    gate_mod.check_gate_config(scfg.lower_bound, scfg.max_drop, scfg.baseline, scfg.baseline_accuracy)
    timings = Timings(digits=None)
    with timings.measure("prepare_s"):
        prepared = _prepare(ctx)
    _log_prepared(ctx, prepared)
    results, baseline, plan, cached = _evaluate(ctx, prepared, timings)
    verdict = None
    if ctx.rank == 0:
        verdict = _decide_and_write(ctx, prepared, results, baseline, plan, cached, timings)
    verdict = broadcast(verdict)
    if not verdict["pass"]:
        raise StageFailed("MMLU gate failed: " + "; ".join(verdict["failures"]),
                          exit_code=ExitCode.GATE_FAILED)
