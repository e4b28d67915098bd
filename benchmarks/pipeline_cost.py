"""The pipeline's own cost on CPU or one GPU: launcher overhead, quantize (calibration) and export time.

    .venv/bin/python benchmarks/pipeline_cost.py --out .bench/results/pipeline_cost.json
    .venv/bin/python benchmarks/pipeline_cost.py --parts overhead          # only the launcher
    .venv/bin/python benchmarks/pipeline_cost.py --parts stages --calib-sizes 8,32,128 --ranks 4

Parts
* ``overhead``: wall time of ``launch <Nano example> --dry-run`` and of
  ``pytest tests/test_examples_resolve.py`` as subprocesses (median and min of ``--runs``).
* ``stages``: ``launch examples/tiny/Qwen3-MoE-tiny/megatron_lm_ptq.yaml`` with only quantize and
  export enabled (mmlu, vllm_smoke off), on random 4-layer Qwen3-MoE checkpoints of each
  ``--widths`` hidden size (128 is the tiny shape; 256 the 2x-wider one: head dim 64, expert FFN
  256; on a GPU e.g. ``--device cuda --widths 1024,2048``), at each ``--calib-sizes`` (samples
  of at most 256 tokens).  Reported: the stage wall time from metadata.json (process start to
  exit: imports, rendezvous, build, work) and the stages' own timings (quantize/summary.json:
  build_and_import_s, calibrate_and_quantize_s; export/verify.json:
  build_and_load_s, export_s, verify_s).  ``--ranks 1`` (default) runs both stages on one rank;
  ``--ranks 4`` uses the example's EP4 quantize and PP4 export.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._common import (MMLU_JSONL, REPO_ROOT, log, markdown_table, median_wall,  # noqa: E402
                                read_jsonl, read_stage_figures, train_small_tokenizer, write_json,
                                write_random_qwen3_moe)

NANO = "examples/nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16/megatron_lm_ptq.yaml"
TINY = "examples/tiny/Qwen3-MoE-tiny/megatron_lm_ptq.yaml"
VENV_BIN = os.path.dirname(sys.executable)


def _launch() -> list[str]:
    """The ``launch`` console script of this interpreter's venv, else ``python -m launcher.cli``
    (a machine where the package is only on PYTHONPATH, e.g. the GPU machine)."""
    p = os.path.join(VENV_BIN, "launch")
    return [p] if os.path.exists(p) else [sys.executable, "-m", "launcher.cli"]


def overhead(runs: int) -> dict:
    out = {}
    log(f"launch {NANO} --dry-run x {runs}")
    out["launch_dry_run_nano"] = median_wall([*_launch(), NANO, "--dry-run"], runs)
    log(f"pytest tests/test_examples_resolve.py x {runs}")
    out["pytest_test_examples_resolve"] = median_wall(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_examples_resolve.py"], runs)
    t = time.perf_counter()
    subprocess.run([sys.executable, "-c", "pass"], check=True)
    out["python_startup_s"] = time.perf_counter() - t
    return out


def card_overrides(hf: str) -> list[str]:
    """``model.<key>=<value>`` for every model-card field derived from the checkpoint's config.json
    (the validator requires the card to agree with the checkpoint)."""
    from launcher.config.hf_card import card_from_hf_config
    from launcher.hf_config import read_hf_config

    out = []
    for key, value in card_from_hf_config(read_hf_config(hf)).items():
        if value is None or isinstance(value, (list, dict)):
            continue
        out.append(f"model.{key}={value}")
    return out


def model_shape(width: int) -> dict:
    """A random 4-layer, 8-expert top-2 Qwen3-MoE of hidden size ``width`` (128: the tiny shape;
    head dim 32..128, expert FFN = width)."""
    heads = max(4, width // 128)
    return dict(hidden=width, heads=heads, head_dim=min(128, width // heads), moe_ffn=width)


def stages(calib_sizes: list[int], ranks: int, work: str, timeout_s: int, widths: list[int],
           device: str, on_result=None) -> list[dict]:
    """One launch per (width, calibration size); ``on_result(results)`` after each, so a run cut
    off by a time limit keeps what it measured."""
    rows = read_jsonl(MMLU_JSONL)
    tok = train_small_tokenizer(os.path.join(work, "tok"),
                                [r["question"] + "\n" + "\n".join(r["choices"]) for r in rows[::3]], 1024)
    calib = os.path.join(work, "calib.jsonl")
    with open(calib, "w") as f:
        for r in rows[: max(calib_sizes) * 2]:
            text = r["question"] + "\n" + "\n".join(f"{l}. {c}" for l, c in zip("ABCD", r["choices"]))
            f.write(json.dumps({"text": text * 3}) + "\n")    # ~256 tokens each after truncation
    models = {f"hidden {w}": model_shape(w) for w in widths}
    results = []
    for mname, m in models.items():
        hf = write_random_qwen3_moe(os.path.join(work, f"h{m['hidden']}"), tok,
                                    hidden=m["hidden"], layers=4, heads=m["heads"], kv_heads=2,
                                    head_dim=m["head_dim"], experts=8, top_k=2, moe_ffn=m["moe_ffn"])
        n_params = sum(os.path.getsize(p) for p in glob.glob(os.path.join(hf, "*.safetensors"))) // 4
        for size in calib_sizes:
            runs_root = os.path.join(work, "runs")
            par = ({"q": "{tp:1,pp:1,ep:1,etp:1,world_size:1}", "e": "{tp:1,pp:1,ep:1,etp:1,world_size:1}"}
                   if ranks == 1 else {"q": "{tp:1,pp:1,ep:4,etp:1,world_size:4}",
                                       "e": "{tp:1,pp:4,ep:1,etp:1,world_size:4}"})
            job = f"cost-h{m['hidden']}-c{size}"
            cmd = [*_launch(), TINY, f"model.path={hf}", *card_overrides(hf),
                   f"stages.quantize.calib.dataset={calib}", f"stages.quantize.calib.size={size}",
                   "stages.quantize.calib.max_seq_len=256", "stages.mmlu.enabled=false",
                   "stages.vllm_smoke.enabled=false", f"stages.quantize.parallel={par['q']}",
                   f"stages.export.parallel={par['e']}", f"runs_root={runs_root}", f"job_name={job}",
                   f"executor.device={device}"]
            log(f"{mname}, calib {size}: {' '.join(cmd)}")
            t = time.perf_counter()
            p = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout_s,
                               env={**os.environ, "OMP_NUM_THREADS": "1" if ranks > 1 else "2"})
            wall = time.perf_counter() - t
            if p.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} exited {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
            run_dir = sorted(glob.glob(os.path.join(runs_root, job, "*")), key=os.path.getmtime)[-1]
            entry = {"model": mname, "params": n_params, "calib_size": size, "ranks": ranks,
                     "launch_wall_s": wall, "run_dir": run_dir, **read_stage_figures(run_dir)}
            results.append(entry)
            if on_result is not None:
                on_result(results)
            log(f"  -> {json.dumps({k: v for k, v in entry.items() if k in ('quantize', 'export')})}")
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=".bench/results/pipeline_cost.json")
    ap.add_argument("--parts", default="overhead,stages")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--calib-sizes", default="8,32,128")
    ap.add_argument("--ranks", type=int, choices=(1, 4), default=1)
    ap.add_argument("--timeout", type=int, default=600, help="per launch, seconds")
    ap.add_argument("--widths", default="128,256", help="hidden sizes of the random Qwen3-MoE models")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="executor.device")
    args = ap.parse_args(argv)
    parts = set(args.parts.split(","))
    doc: dict = {"benchmark": "pipeline_cost", "args": vars(args), "cpu_count": os.cpu_count()}
    t_all = time.perf_counter()
    if "overhead" in parts:
        doc["overhead"] = overhead(args.runs)
        o = doc["overhead"]
        print(markdown_table(["command", "median s", "min s", "runs"], [
            [f"launch {NANO} --dry-run", o["launch_dry_run_nano"]["median_s"], o["launch_dry_run_nano"]["min_s"],
             len(o["launch_dry_run_nano"]["runs_s"])],
            ["pytest tests/test_examples_resolve.py", o["pytest_test_examples_resolve"]["median_s"],
             o["pytest_test_examples_resolve"]["min_s"], len(o["pytest_test_examples_resolve"]["runs_s"])],
            ["python -c pass (interpreter start)", o["python_startup_s"], o["python_startup_s"], 1]]))
        print()
    if "stages" in parts:
        work = tempfile.mkdtemp(prefix="bench-cost-")
        def keep(partial: list[dict]) -> None:
            write_json(args.out, {**doc, "stages": partial, "complete": False})

        res = stages([int(s) for s in args.calib_sizes.split(",")], args.ranks, work, args.timeout,
                     [int(w) for w in args.widths.split(",")], args.device, on_result=keep)
        doc["stages"] = res
        base = {r["model"]: r for r in res if r["calib_size"] == res[0]["calib_size"]}
        rows = []
        for r in res:
            q, e = r.get("quantize", {}), r.get("export", {})
            rows.append([r["model"], f"{r['params'] / 1e6:.2f} M", r["calib_size"], r["ranks"],
                         q.get("wall_s"), q.get("calibrate_and_quantize_s"), q.get("build_and_import_s"),
                         e.get("wall_s"), e.get("export_s"), e.get("verify_s"),
                         (q.get("calibrate_and_quantize_s") or 0) / max(1e-9, base[r["model"]]["quantize"].get(
                             "calibrate_and_quantize_s") or 1e-9)])
        print(markdown_table(["model", "params", "calib samples", "ranks", "quantize wall s",
                              "calibrate+quantize s", "build+import s", "export wall s",
                              "export s", "verify s", "calib time vs smallest"], rows))
    doc["total_s"] = time.perf_counter() - t_all
    doc["complete"] = True
    write_json(args.out, doc)
    print(f"\nwrote {args.out} ({doc['total_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
