"""MMLU gate throughput on CPU: EP4 on 4 gloo ranks, `balanced` vs `lockstep`, vs one rank (EP1).

    .venv/bin/python benchmarks/mmlu_throughput.py --out .bench/results/mmlu_throughput.json

What runs: the product path (``launcher.mmlu.prepared.prepare`` -> ``launcher.mmlu.evaluate.
evaluate_model``: shard plan, desync guard, Megatron-Core forward, gather on rank 0) on the tiny
Qwen3-MoE (``launcher_testing.tiny.ensure_tiny_model()``: its hf/ and mmlu/test.jsonl) - or, with
``--model random`` (or when the tiny build is absent and ``--model auto``), a random tiny
Qwen3-MoE checkpoint with the tiny tokenizer recipe trained on MMLU text, evaluated on a
``--fraction`` of the real MMLU test split (.bench/mmlu/test.jsonl).

One 4-rank job (EP=4, DP=4, EDP=1) evaluates the same prepared questions with
shard_mode=balanced and shard_mode=lockstep, alternating, ``--repeats`` times each; a 1-rank job
(EP=1) evaluates them once per repeat.  Every evaluation is bracketed by barriers; the wall time
is rank 0's.  Per rank we also record forward calls, dummy forwards and the process CPU time:
with 4 ranks on a 2-core machine (shared with others) the wall time is bounded by the cores, so
the per-rank work (forward calls, padded tokens, CPU seconds) is the machine-independent figure.

Checks: predictions of balanced, lockstep and EP1 are identical question by question (exit 1
otherwise).  Padding efficiency = real tokens / padded tokens, with the plan's dummy forwards
counted, for the batches with and without the token budget (``--max-batch-tokens``).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._common import (MMLU_JSONL, log, markdown_table, read_jsonl,  # noqa: E402
                                run_on_ranks, train_small_tokenizer, write_json,
                                write_random_qwen3_moe)


def mmlu_cfg(dataset: str, fraction: float, batch_size: int, max_batch_tokens):
    from omegaconf import OmegaConf

    from launcher.schema import MmluStage

    return OmegaConf.merge(OmegaConf.structured(MmluStage(dataset=dataset)),
                           {"fraction": fraction, "few_shots": 0, "batch_size": batch_size,
                            "max_batch_tokens": max_batch_tokens})


# ------------------------------------------------------------------------------- rank worker

def worker(hf_path: str, dataset: str, fraction: float, batch_size: int, max_batch_tokens,
           modes: list, repeats: int, dispatcher: str = "alltoall") -> dict:
    import torch
    import torch.distributed as dist

    from launcher.megatron.dist import init_distributed, shutdown
    from launcher.megatron.forward import forward_logits
    from launcher.megatron.hf_io import import_hf_weights
    from launcher.megatron.models import build_model
    from launcher.mmlu.evaluate import evaluate_model
    from launcher.mmlu.prepared import load_tokenizer, prepare
    from launcher.topology import ParallelDims

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dims = ParallelDims(world_size=world, ep=world)
    init_distributed(dims, "cpu", timeout_s=300, seed=1234)
    prepared = prepare(mmlu_cfg(dataset, fraction, batch_size, max_batch_tokens), load_tokenizer(hf_path))
    model = build_model(hf_path, dims, "cpu", "float32", dispatcher)
    import_hf_weights(model, hf_path, "float32")
    # warm-up: one forward on every rank together (EP collectives)
    forward_logits(model, torch.full((2, 16), int(prepared.pad_id), dtype=torch.long))
    dist.barrier()
    cache: dict = {}
    runs = []
    preds = {}
    for rep in range(repeats):
        for mode in modes:
            dist.barrier()
            t, c = time.perf_counter(), time.process_time()
            res, plan, run = evaluate_model(model, prepared, dims, rank, mode, dispatcher,
                                            timeout_s=300, label=mode, groups_cache=cache)
            cpu = time.process_time() - c
            mine = time.perf_counter() - t
            dist.barrier()
            wall = time.perf_counter() - t
            runs.append({"mode": mode, "repeat": rep, "wall_s": wall, "rank_eval_s": mine,
                         "rank_cpu_s": cpu, "forward_s": sum(run.step_seconds),
                         "forward_calls": run.forward_calls, "dummies": run.dummies,
                         "padded_tokens": plan.padded_tokens()[rank]})
            if rank == 0:
                preds[mode] = [res[i][0] for i in range(len(prepared.prompts))]
    shutdown()
    return {"rank": rank, "world": world, "runs": runs, "predictions": preds if rank == 0 else None,
            "n_questions": len(prepared.prompts), "n_batches": len(prepared.batches)}


# ------------------------------------------------------------------------------------ driver

def resolve_model(kind: str, work: str, fraction: float):
    """(hf_path, dataset jsonl, description)."""
    if kind in ("auto", "tiny"):
        from launcher_testing.tiny.build import Recipe, default_dir, is_current

        d = default_dir()
        if kind == "tiny" or is_current(d, Recipe()):
            from launcher_testing.tiny.build import ensure_tiny_model

            d = ensure_tiny_model()
            return str(d / "hf"), str(d / "mmlu" / "test.jsonl"), 1.0, f"tiny Qwen3-MoE ({d})"
        log("the tiny model is not built (launcher_testing.tiny.ensure_tiny_model); using a random tiny "
            "Qwen3-MoE on real MMLU (--model tiny builds it)")
    rows = read_jsonl(MMLU_JSONL)
    tok_dir = os.path.join(work, "tok")
    texts = [r["question"] + "\n" + "\n".join(r["choices"]) for r in rows[::3]]
    train_small_tokenizer(tok_dir, texts, 1024)
    hf = write_random_qwen3_moe(os.path.join(work, "hf"), tok_dir, hidden=128, layers=4, heads=4,
                                kv_heads=2, head_dim=32, experts=8, top_k=2, moe_ffn=128)
    return hf, MMLU_JSONL, fraction, (f"random Qwen3-MoE (hidden 128, 4 layers, 8 experts top-2, "
                                      f"1024-token BPE) on {fraction:g} of real MMLU")


def padding_table(hf: str, dataset: str, fraction: float, batch_size: int, budget, ranks: int) -> dict:
    from launcher.mmlu.batching import make_batches, padding_efficiency
    from launcher.mmlu.sharding import plan_shards
    from launcher.mmlu.prepared import load_tokenizer, prepare
    from launcher.topology import ParallelDims

    prepared = prepare(mmlu_cfg(dataset, fraction, batch_size, None), load_tokenizer(hf))
    lengths = [len(t) for t in prepared.token_ids]
    dims = ParallelDims(world_size=ranks, ep=ranks)
    out = {"n_questions": len(lengths), "prompt_tokens": {
        "min": min(lengths), "median": statistics.median(lengths), "max": max(lengths),
        "total": sum(lengths)}}
    for name, bs, mbt in (("batch_size only", batch_size, None),
                          ("batch_size + token budget", batch_size, budget),
                          ("token budget only (batch_size 4096)", 4096, budget)):
        batches = make_batches(lengths, bs, mbt)
        row = {"batch_size": bs, "max_batch_tokens": mbt, "batches": len(batches),
               "efficiency_batches": padding_efficiency(batches)}
        for mode in ("balanced", "lockstep"):
            plan = plan_shards([b.shape for b in batches], dims, mode, "alltoall")
            row[f"efficiency_{mode}_ep{ranks}"] = padding_efficiency(batches, plan.shard_padded_tokens())
            row[f"forward_calls_{mode}_ep{ranks}"] = plan.forward_calls()
        out[name] = row
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=".bench/results/mmlu_throughput.json")
    ap.add_argument("--model", choices=("auto", "tiny", "random"), default="auto")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--fraction", type=float, default=0.02,
                    help="fraction per subject of real MMLU (random model only; the tiny model "
                         "uses its whole test set)")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--max-batch-tokens", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--skip-single", action="store_true", help="no EP1 one-rank run")
    args = ap.parse_args(argv)

    work = tempfile.mkdtemp(prefix="bench-mmlu-tp-")
    t_all = time.perf_counter()
    hf, dataset, fraction, desc = resolve_model(args.model, work, args.fraction)
    log(f"model: {desc}")
    pad = padding_table(hf, dataset, fraction, args.batch_size, args.max_batch_tokens, args.ranks)
    kw = dict(hf_path=hf, dataset=dataset, fraction=fraction, batch_size=args.batch_size,
              max_batch_tokens=args.max_batch_tokens, repeats=args.repeats)
    log(f"{args.ranks}-rank EP{args.ranks} job: balanced and lockstep x {args.repeats}")
    multi = run_on_ranks("benchmarks.mmlu_throughput:worker", args.ranks,
                         {**kw, "modes": ["balanced", "lockstep"]}, timeout_s=1800)
    single = None
    if not args.skip_single:
        log("1-rank EP1 job")
        single = run_on_ranks("benchmarks.mmlu_throughput:worker", 1,
                              {**kw, "modes": ["balanced"]}, timeout_s=1800)

    n = multi[0]["n_questions"]

    def summarize(results, mode, label):
        per_rank = [[r for r in res["runs"] if r["mode"] == mode] for res in results]
        walls = [r["wall_s"] for r in per_rank[0]]
        best = min(walls)
        return {
            "label": label, "mode": mode, "ranks": len(results), "wall_s_best": best,
            "wall_s_all": walls, "examples_per_s": n / best,
            "forward_calls_per_rank": [pr[0]["forward_calls"] for pr in per_rank],
            "dummies_per_rank": [pr[0]["dummies"] for pr in per_rank],
            "padded_tokens_per_rank": [pr[0]["padded_tokens"] for pr in per_rank],
            "cpu_s_per_rank": [min(r["rank_cpu_s"] for r in pr) for pr in per_rank],
            "forward_s_per_rank": [min(r["forward_s"] for r in pr) for pr in per_rank],
        }

    rows = [summarize(multi, "balanced", f"EP{args.ranks} balanced"),
            summarize(multi, "lockstep", f"EP{args.ranks} lockstep")]
    preds = {"balanced": multi[0]["predictions"]["balanced"],
             "lockstep": multi[0]["predictions"]["lockstep"]}
    if single:
        rows.append(summarize(single, "balanced", "EP1, 1 rank"))
        preds["ep1"] = single[0]["predictions"]["balanced"]
    ref = preds["balanced"]
    mismatches = {k: sum(a != b for a, b in zip(ref, v)) for k, v in preds.items()}
    identical = all(m == 0 for m in mismatches.values())

    bal, lock = rows[0], rows[1]
    ratios = {
        "balanced_over_lockstep_wall": lock["wall_s_best"] / bal["wall_s_best"],
        "lockstep_over_balanced_forward_calls_max_rank":
            max(lock["forward_calls_per_rank"]) / max(bal["forward_calls_per_rank"]),
        "lockstep_over_balanced_padded_tokens_max_rank":
            max(lock["padded_tokens_per_rank"]) / max(bal["padded_tokens_per_rank"]),
        "lockstep_over_balanced_cpu_s_max_rank":
            max(lock["cpu_s_per_rank"]) / max(bal["cpu_s_per_rank"]),
    }
    if single:
        ratios["balanced_over_ep1_wall"] = rows[2]["wall_s_best"] / bal["wall_s_best"]

    print(f"\nMMLU throughput, CPU gloo, {desc}; {n} questions, {multi[0]['n_batches']} batches "
          f"(batch_size {args.batch_size}, max_batch_tokens {args.max_batch_tokens}); "
          f"cores: {os.cpu_count()}, OMP_NUM_THREADS=1 per rank\n")
    print(markdown_table(
        ["run", "wall s (best)", "examples/s", "forward calls / rank", "dummies / rank",
         "padded tokens / rank", "CPU s / rank"],
        [[r["label"], r["wall_s_best"], r["examples_per_s"], r["forward_calls_per_rank"],
          r["dummies_per_rank"], r["padded_tokens_per_rank"],
          "[" + ", ".join(f"{x:.1f}" for x in r["cpu_s_per_rank"]) + "]"] for r in rows]))
    print()
    print(markdown_table(["ratio", "value"], [[k, v] for k, v in ratios.items()]))
    print()
    print(f"prompt tokens: {pad['prompt_tokens']}")
    print(markdown_table(
        ["batching", "batches", "efficiency (batches)", f"efficiency balanced EP{args.ranks} (+dummies)",
         f"efficiency lockstep EP{args.ranks}"],
        [[k, v["batches"], v["efficiency_batches"], v[f"efficiency_balanced_ep{args.ranks}"],
          v[f"efficiency_lockstep_ep{args.ranks}"]]
         for k, v in pad.items() if isinstance(v, dict) and "batches" in v]))
    print()
    print(f"predictions identical (balanced vs lockstep vs EP1): {identical}  mismatches: {mismatches}")
    doc = {"benchmark": "mmlu_throughput", "model": desc, "hf_path": hf, "dataset": dataset,
           "fraction": fraction, "n_questions": n, "args": vars(args), "cpu_count": os.cpu_count(),
           "runs": rows, "ratios": ratios, "padding": pad, "predictions_identical": identical,
           "mismatches": mismatches,
           "targets": {"balanced_over_lockstep>=3": ratios["balanced_over_lockstep_wall"] >= 3,
                       "padding_efficiency_with_budget>=0.95":
                           pad["batch_size + token budget"]["efficiency_balanced_ep%d" % args.ranks] >= 0.95},
           "total_s": time.perf_counter() - t_all}
    write_json(args.out, doc)
    print(f"wrote {args.out}")
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
