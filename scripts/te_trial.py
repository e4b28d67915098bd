#!/usr/bin/env python3
"""TransformerEngine tried for real (issue 22): the tiny Qwen3-MoE gate's questions through Megatron's
TE layer spec and through the local spec the launcher uses, on one GPU, compared.

    python3 scripts/te_trial.py RUN_DIR --out te_trial.json [--quant none,nvfp4,fp8]
    python3 scripts/te_trial.py RUN_DIR --out x.json --device cpu --specs local --limit 64   # the plumbing, on CPU

RUN_DIR is a run of ``examples/tiny/Qwen3-MoE-tiny`` on cuda (``gpu_checks.sh`` part ``pipeline``
leaves one under /tmp/gpu-runs): its config.yaml names the checkpoint and the gate's questions, and
its ``mmlu/results.json`` the gate's own predictions. For each ``--quant`` entry both models are
built from the same HF weights in bf16 (``build_model(layer_spec="local" | "te")``), quantized the
same way where asked (ModelOpt's NVFP4 or FP8 default config, calibrated on the same first
``--calib-prompts`` of the gate's prompts, one at a time), and evaluated with the gate's batches through plain
Megatron forwards (no folding, no grouped experts, no eval kernels: the same path for both specs).

The JSON holds, per recipe: each spec's accuracy and seconds, the two specs compared as
``benchmarks/mmlu_gpu.py`` compares its runs (``benchmarks._mmlu_bench_model.compare``: the
predictions that differ, those whose both margins exceed ``--tie-eps``, the largest and the median
per-question choice-logit difference, each changed question's margins), and the share of each spec's
predictions that the gate run recorded (``mmlu/results.json``; the gate folds quantizers and groups
experts, so a quantized recipe need not agree exactly). An exception in one spec or recipe is
recorded with its message and the trial goes on.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks._mmlu_bench_model import QUANT_RECIPES, compare  # noqa: E402

RECIPES = {"none": None, **QUANT_RECIPES}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", help="a run of examples/tiny/Qwen3-MoE-tiny on cuda (config.yaml, mmlu/)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--quant", default="none,nvfp4,fp8", help=f"comma-separated, of {list(RECIPES)}")
    ap.add_argument("--calib-prompts", type=int, default=32)
    ap.add_argument("--tie-eps", type=float, default=0.05)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: the local spec only")
    ap.add_argument("--specs", default="local,te", help="comma-separated layer specs: local, te")
    ap.add_argument("--limit", type=int, default=0, help="only the first N questions (0: all)")
    args = ap.parse_args(argv)
    specs = [s for s in args.specs.split(",") if s]
    if not specs or not set(specs) <= {"local", "te"} or len(set(specs)) != len(specs):
        ap.error(f"--specs: {args.specs!r} not valid; valid: 'local', 'te' or 'local,te'")
    recipes = [r for r in args.quant.split(",") if r]
    bad = [r for r in recipes if r not in RECIPES]
    if bad:
        ap.error(f"--quant: {bad} not valid; valid values: {list(RECIPES)}")

    import torch

    from launcher.config.compose import load_run_config
    from launcher.contract import RunLayout
    from launcher.megatron.dist import init_distributed, shutdown
    from launcher.megatron.forward import forward_logits
    from launcher.megatron.hf_io import import_hf_weights
    from launcher.megatron.models import build_model, unwrap_model
    from launcher.mmlu.evaluate import batch_limits, evaluate_model
    from launcher.mmlu.prepared import load_tokenizer, prepare
    from launcher.topology import ParallelDims

    cfg = load_run_config(RunLayout(args.run_dir).config_yaml)
    scfg, hf_path = cfg.stages.mmlu, cfg.model.path
    doc = {"run_dir": args.run_dir, "model": hf_path, "torch": torch.__version__, "specs": specs,
           "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "recipes": {}}
    try:
        if "te" not in specs:
            raise ImportError("not asked for (--specs)")
        import transformer_engine
        import transformer_engine.pytorch  # noqa: F401

        doc["transformer_engine"] = transformer_engine.__version__
    except Exception as e:
        doc["transformer_engine"] = None
        if "te" in specs:   # the whole trial's answer: TE does not import here
            doc["error"] = f"import transformer_engine.pytorch: {type(e).__name__}: {e}"
            _write(args.out, doc)
            print(doc["error"])
            return 1

    from benchmarks._common import single_rank_env

    single_rank_env()
    dims = ParallelDims(world_size=1)
    init_distributed(dims, args.device, timeout_s=300, seed=1234, architecture="Qwen3MoeForCausalLM")
    tokenizer = load_tokenizer(hf_path, bool(cfg.model.trust_remote_code))
    prepared = prepare(scfg, tokenizer, batch_limits(scfg, args.device, hf_path), None)
    if args.limit:
        prepared = _first(prepared, args.limit)
    answers = [p.question.answer for p in prepared.prompts]
    calib = [torch.tensor([ids]) for ids in prepared.token_ids[:args.calib_prompts]]
    gate = _gate_predictions(args.run_dir)
    print(f"[te-trial] TE {doc['transformer_engine']} on {args.device}, {len(prepared.prompts)} questions, "
          f"{len(prepared.batches)} batches, {len(calib)} calibration prompts; the gate run's predictions: "
          f"{len(gate)}", flush=True)

    for recipe in recipes:
        entry = doc["recipes"][recipe] = {}
        preds = {}
        for spec in specs:
            t0 = time.perf_counter()
            model = None
            try:
                model = build_model(hf_path, dims, args.device, "bfloat16", "alltoall", layer_spec=spec)
                import_hf_weights(model, hf_path, "bfloat16")
                if RECIPES[recipe]:
                    import modelopt.torch.quantization as mtq

                    mtq.quantize(unwrap_model(model), getattr(mtq, RECIPES[recipe]),
                                 lambda _m: [forward_logits(model, t) for t in calib])
                results, _, _ = evaluate_model(model, prepared, dims, 0, stage="te-trial", label=f"{recipe}/{spec}")
                preds[spec] = results
                correct = sum(results[i].choice == a for i, a in enumerate(answers))
                entry[spec] = {"accuracy": correct / len(answers), "correct": correct,
                               "seconds": round(time.perf_counter() - t0, 2)}
                print(f"[te-trial] {recipe}/{spec}: {correct}/{len(answers)} in {entry[spec]['seconds']} s", flush=True)
            except Exception as e:
                entry[spec] = {"error": f"{type(e).__name__}: {e}"[:2000],
                               "traceback": traceback.format_exc()[-4000:]}
                print(f"[te-trial] {recipe}/{spec} FAILED: {entry[spec]['error']}", flush=True)
            finally:
                del model
                if args.device == "cuda":
                    torch.cuda.empty_cache()
        if len(preds) == 2:
            entry["local_vs_te"] = compare(preds["local"], preds["te"], args.tie_eps)
            print(f"[te-trial] {recipe}: {json.dumps(entry['local_vs_te'])}", flush=True)
        for spec in preds if gate else ():
            shared = [i for i in gate if i in preds[spec]]
            entry[spec]["agrees_with_the_gate_run"] = sum(preds[spec][i].choice == gate[i] for i in shared) / len(shared)
        _write(args.out, doc)
    shutdown()
    _write(args.out, doc)
    failed = [f"{r}/{s}" for r, e in doc["recipes"].items() for s in specs if "error" in e.get(s, {})]
    print(f"[te-trial] wrote {args.out}" + (f"; failed: {failed}" if failed else ""))
    return 1 if failed else 0


def _first(prepared, n: int):
    """``prepared`` cut to its first ``n`` questions, batched again with the same limits."""
    from launcher.mmlu.batching import make_batches_for
    from launcher.mmlu.prepared import Prepared

    ids = prepared.token_ids[:n]
    return Prepared(prepared.prompts[:n], ids, make_batches_for([len(t) for t in ids], prepared.limits),
                    prepared.choice_ids, prepared.pad_id, prepared.truncated, prepared.limits, prepared.token_cache)


def _gate_predictions(run_dir: str) -> dict:
    """The gate run's own choices by prompt position (its results.json lists the questions in the
    prepared order), or {} where the file is missing."""
    from launcher.mmlu.data import LETTERS

    try:
        rows = json.load(open(os.path.join(run_dir, "mmlu", "results.json"))).get("questions") or []
    except (OSError, ValueError):
        return {}
    return {i: LETTERS.index(r["prediction"]) for i, r in enumerate(rows)}


def _write(path: str, doc: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
