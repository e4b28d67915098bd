"""The torch side: run a shard plan through a Megatron model and gather per-prompt results.

``run_plan`` executes this rank's steps (guard check before every forward, one prefill per
batch, right padding: causal attention leaves the real positions untouched), runs the LM head
only at each prompt's last real token (``forward_logits(positions=...)``), reads the four choice
logits there on the last pipeline stage, and keeps the rows of the batches this rank owns.
``gather_to_rank0`` collects them on rank 0.  ``batch_limits`` resolves the stage's batch limits
for the device (on CUDA, from every rank's memory).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from launcher.mmlu.batching import Batch, BatchLimits
from launcher.mmlu.guard import StepGuard
from launcher.mmlu.results import Prediction
from launcher.mmlu.sharding import ShardPlan


@dataclass
class EvalRun:
    results: dict[int, Prediction]   # prompt index -> (choice, 4 logits)
    forward_calls: int = 0
    dummies: int = 0
    seconds: float = 0.0
    step_seconds: list[float] = field(default_factory=list)


def run_plan(model, token_ids: Sequence[Sequence[int]], batches: Sequence[Batch], plan: ShardPlan,
             rank: int, choice_ids: Sequence[int], pad_id: int, guard: StepGuard,
             log: Optional[Callable[[str], None]] = None, label: str = "",
             log_every: int = 1) -> EvalRun:
    import torch

    from launcher.megatron.forward import forward_logits, model_device

    steps = plan.for_rank(rank)
    n = len(steps)
    run = EvalRun(results={})
    choice = torch.tensor(list(choice_ids), dtype=torch.long, device=model_device(model))
    t0 = time.time()
    done_q = 0
    for i, st in enumerate(steps):
        guard.check(i, n, st.padded_len, st.rows)
        tokens = torch.full((st.rows, st.padded_len), int(pad_id), dtype=torch.long)
        batch = batches[st.batch] if st.batch is not None else None
        last = torch.zeros(st.rows, dtype=torch.long)   # dummy rows: position 0
        if batch is not None:
            for row, p in enumerate(batch.items):
                ids = token_ids[p]
                tokens[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
                last[row] = len(ids) - 1
        ts = time.time()
        logits = forward_logits(model, tokens, positions=last)   # [rows, V]: each row's last real token
        run.step_seconds.append(time.time() - ts)
        run.forward_calls += 1
        if batch is None:
            run.dummies += 1
        elif logits is not None and plan.owner.get(st.batch) == rank:
            sel = logits[: len(batch.items)][:, choice].cpu()   # forward_logits returns float32
            for row, p in enumerate(batch.items):
                vals = sel[row].tolist()
                run.results[p] = Prediction(int(sel[row].argmax().item()), vals)
        if batch is not None:
            done_q += batch.rows
        if log is not None and ((i + 1) % log_every == 0 or i + 1 == n):
            el = time.time() - t0
            log(f"{label}step {i + 1}/{n} ({'dummy' if batch is None else f'{st.rows}x{st.padded_len}'})"
                f" {done_q / el if el > 0 else 0.0:.1f} questions/s on this rank")
    guard.finish(n)
    run.seconds = time.time() - t0
    return run


def gather_to_rank0(local: dict, rank: int, world_size: int) -> Optional[dict]:
    """Merge every rank's {prompt index: result} on rank 0 (None elsewhere)."""
    from launcher.megatron.collectives import gather_to_rank0 as gather

    if world_size == 1:
        return dict(local)
    box = gather(local, rank)
    if rank != 0:
        return None
    merged: dict = {}
    for part in box:
        for k, v in part.items():
            if k in merged:
                raise AssertionError(f"prompt {k} reported by two ranks")
            merged[k] = v
    return merged


def batch_limits(scfg, device: str, hf_path: str) -> BatchLimits:
    """``stages.mmlu.batch_size``/``max_batch_tokens`` resolved for ``device`` (auto on CUDA reads
    the device's memory and the model's dimensions from config.json)."""
    from launcher.megatron.collectives import all_gather
    from launcher.mmlu.batching import AUTO, activation_bytes_per_token, resolve_limits

    mem = per_token = None
    moe = False
    if scfg.batch_size == AUTO and device == "cuda":
        import torch

        from launcher.hf_config import read_hf_config

        hf = read_hf_config(hf_path)
        topk = int(hf.get("num_experts_per_tok") or 0)
        moe = topk > 0
        mem = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        mem = min(all_gather(mem))   # one budget, one shard plan
        per_token = activation_bytes_per_token(
            hf["hidden_size"], hf.get("intermediate_size") or 4 * hf["hidden_size"], topk,
            int(hf.get("moe_intermediate_size") or 0))
    return resolve_limits(scfg.batch_size, scfg.max_batch_tokens, device, mem, per_token, moe)


def evaluate_model(model, prepared, dims, rank: int, mode: str = "auto",
                   dispatcher: str = "alltoall", timeout_s: float = 45.0,
                   allow_unsafe: bool = False, stage: str = "mmlu", label: str = "",
                   log: Optional[Callable[[str], None]] = None, groups_cache: Optional[dict] = None):
    """Plan, guard, run and gather one evaluation of ``prepared`` (``launcher.mmlu.prepared.Prepared``).

    Returns (results on rank 0 else None, plan, this rank's EvalRun).  ``groups_cache`` (a dict)
    reuses guard groups across calls with the same components (group creation is collective).
    """
    from launcher.mmlu.guard import make_groups
    from launcher.mmlu.sharding import plan_shards

    plan = plan_shards([b.shape for b in prepared.batches], dims, mode, dispatcher, allow_unsafe)
    key = (tuple(map(tuple, plan.components)), float(timeout_s))
    if groups_cache is not None and key in groups_cache:
        groups = groups_cache[key]
    else:
        groups = make_groups(plan, timeout_s)
        if groups_cache is not None:
            groups_cache[key] = groups
    guard = StepGuard(plan, rank, groups, stage=stage, timeout_s=timeout_s, label=label)
    n = len(plan.for_rank(rank))
    run = run_plan(model, prepared.token_ids, prepared.batches, plan, rank, prepared.choice_ids,
                   prepared.pad_id, guard, log=log, label=f"{label}: " if label else "",
                   log_every=max(1, n // 20))
    merged = gather_to_rank0(run.results, rank, dims.world_size)
    if merged is not None and len(merged) != len(prepared.prompts):
        raise AssertionError(f"gathered {len(merged)} results for {len(prepared.prompts)} prompts")
    return merged, plan, run


def prepare_model_for_eval(model, log: Optional[Callable[[str], None]] = None, export_dtype=None) -> dict:
    """Fold constant weight quantization (``launcher.megatron.fold``), then run the MoE experts as
    grouped GEMMs (``launcher.megatron.grouped_experts``).  Predictions are unchanged: on CPU both
    are bit-exact (tests/test_eval_fast_paths.py); on a GPU the grouped GEMM kernel sums in
    another order than the per-expert matmuls (benchmarks/mmlu_gpu.py counts the changes).
    Call ``release_model_after_eval`` before loading a checkpoint into the same model.
    ``export_dtype``: the dtype the export stage writes in (the folded weights are the exported ones)."""
    from launcher.megatron.fold import fold_weight_quantizers
    from launcher.megatron.grouped_experts import enable_grouped_experts

    t = time.time()
    folded = fold_weight_quantizers(model, export_dtype)
    grouped = enable_grouped_experts(model)
    report = {"folded_weight_quantizers": folded["folded"], "folded_as_exported": folded["as_exported"],
              "not_folded_shared": folded["skipped_shared"],
              "grouped_expert_layers": len(grouped["grouped"]), "expert_layers_kept": grouped["kept"],
              "expert_input_quantization": sorted({v for q in grouped["input_quantization"].values()
                                                   for v in q.values()}),
              "seconds": time.time() - t}
    if log is not None:
        kept = f"; kept per-expert loop: {grouped['kept']}" if grouped["kept"] else ""
        log(f"eval model: {folded['folded']} weight quantizers folded, {len(grouped['grouped'])} MoE layers "
            f"grouped (expert input quantization: {report['expert_input_quantization']}){kept}")
    return report


def release_model_after_eval(model) -> None:
    """Undo ``prepare_model_for_eval``'s forward change (folded weights stay folded)."""
    from launcher.megatron.grouped_experts import disable_grouped_experts

    disable_grouped_experts(model)
