"""Quantization quality of SmolLM2-135M-Instruct per recipe: the paired MMLU gate, side by side.

    nice -n 10 .venv/bin/python benchmarks/smollm2_quality.py --mmlu ../shared/data/mmlu/test.jsonl \\
        --fraction 0.05 --recipes fp8_default,nvfp4_default,nvfp4_mlp_weight_only --out runs/smollm2_quality

Each recipe is one `launch examples/HuggingFaceTB/SmolLM2-135M-Instruct/megatron_lm_ptq.yaml
recipe=R` (quantize at PP2, the gate at DP2, export off) with ``baseline: evaluate`` and one
baseline cache for all of them: the fp32 baseline is evaluated by the first run and read from
the cache by the others, so every recipe is compared with the same baseline predictions on the
same questions (lm-eval's 0-shot MMLU prompts, ``fraction`` of every subject).  Prints a
Markdown table (accuracy, paired drop with its McNemar-exact 95% interval and p-value, agreement,
mean KL over A-D) and writes ``<out>/quality.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(REPO_ROOT, "examples", "HuggingFaceTB", "SmolLM2-135M-Instruct", "megatron_lm_ptq.yaml")


def run_recipe(recipe: str, args, out: str) -> dict:
    cmd = [sys.executable, "-m", "launcher.cli", EXAMPLE, f"recipe={recipe}", f"runs_root={out}/runs",
           f"job_name=smollm2-quality-{recipe.replace('_', '-')}", f"stages.mmlu.dataset={os.path.abspath(args.mmlu)}",
           f"stages.mmlu.fraction={args.fraction}", "stages.mmlu.max_drop=1.0", "stages.export.enabled=false",
           f"stages.mmlu.baseline_cache_dir={out}/baseline_cache", f"stages.quantize.calib.size={args.calib_size}"]
    print(f"[quality] {recipe}: {' '.join(cmd[2:])}", flush=True)
    t = time.time()
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True)
    wall = time.time() - t
    log = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise SystemExit(f"[quality] {recipe} failed (exit {proc.returncode}):\n{log[-4000:]}")
    run_dir = log.split("[launch] run directory: ")[1].split("\n")[0].strip()
    with open(os.path.join(run_dir, "mmlu", "results.json")) as f:
        res = json.load(f)
    paired = res["baseline"]["paired"]
    row = {"recipe": recipe, "n": res["n"], "baseline_accuracy": res["baseline"]["accuracy"],
           "accuracy": res["accuracy"], "drop": res["baseline"]["drop"], "drop_interval": paired["interval"],
           "p_value": paired["p_value"], "lost": paired["n10"], "gained": paired["n01"],
           "agreement": res["agreement"], "mean_kl": res["mean_kl"], "baseline_source": res["baseline"]["source"],
           "wall_s": round(wall, 1), "run_dir": run_dir}
    print(f"[quality] {recipe}: {json.dumps(row)}", flush=True)
    return row


def table(rows: list[dict]) -> str:
    lines = ["| recipe | n | accuracy (fp32 baseline) | paired drop [95% interval] | McNemar p | lost / gained | agreement | mean KL (nats) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lo, hi = r["drop_interval"]
        lines.append(f"| {r['recipe']} | {r['n']} | {r['accuracy']:.4f} ({r['baseline_accuracy']:.4f}) | "
                     f"{r['drop']:+.4f} [{lo:+.4f}, {hi:+.4f}] | {r['p_value']:.3f} | {r['lost']} / {r['gained']} | "
                     f"{r['agreement']:.3f} | {r['mean_kl']:.4f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mmlu", required=True, help="MMLU test jsonl (cais/mmlu schema)")
    p.add_argument("--fraction", type=float, default=0.05)
    p.add_argument("--recipes", default="fp8_default,nvfp4_default,nvfp4_mlp_weight_only")
    p.add_argument("--calib-size", type=int, default=32)
    p.add_argument("--out", default=os.path.join(REPO_ROOT, "runs", "smollm2_quality"))
    args = p.parse_args(argv)
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    rows = []
    for recipe in args.recipes.split(","):
        rows.append(run_recipe(recipe, args, out))
        tmp = os.path.join(out, "quality.json.tmp")   # after every recipe: a long run keeps what it measured
        with open(tmp, "w") as f:
            json.dump({"fraction": args.fraction, "mmlu": args.mmlu, "rows": rows, "table": table(rows)}, f, indent=1)
        os.replace(tmp, os.path.join(out, "quality.json"))
    if [r["baseline_source"] for r in rows][1:] != ["cache"] * (len(rows) - 1):
        print("[quality] WARNING: the baseline was not read from the cache after the first recipe", flush=True)
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
