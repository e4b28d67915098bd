"""What a stage's rank start-up costs, and what starting ranks by fork would save, side by side:

    .venv/bin/python benchmarks/rank_startup.py                    # 4 ranks, 3 repeats each way
    .venv/bin/python benchmarks/rank_startup.py --nprocs 4 --repeats 3 --out benchmarks/results/x.json

Every stage of ``launch`` starts its ranks as new interpreters (the local agent spawns them), and each
rank imports torch, Megatron-Core, ModelOpt and transformers before its first line of work.  On a
machine with fewer cores than ranks those imports run side by side on the same cores.  This script
times, for ``--nprocs`` ranks, from the start until every rank has its imports and has run one torch op:

- ``spawned``: ``--nprocs`` new interpreters at once, each importing ``--modules`` (what a stage does today);
- ``forked``: one interpreter imports ``--modules`` once, then forks ``--nprocs`` children;
- ``one``: a single interpreter importing ``--modules`` (the per-rank cost on an idle core).

It prints the median of each, the ratio spawned/forked and the cores this machine has.

``--pipeline N`` then runs the product itself, ``launch`` of the tiny example (quantize NVFP4 at EP4 ->
gate -> export; the smoke off), N times with each ``executor.rank_start`` (``spawn``: every rank a new
interpreter; ``auto``: on CPU, ranks forked from an agent that imported the stack once), interleaved;
it prints each way's median wall and per-stage seconds and the ratio, and fails if the two ways'
exports differ by a byte (sha256 of every file under export/hf):

    .venv/bin/python benchmarks/rank_startup.py --repeats 1 --pipeline 2 --out benchmarks/results/y.json
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._common import REPO_ROOT, log, markdown_table, read_stage_figures, write_json  # noqa: E402

MODULES = "torch,megatron.core,modelopt.torch.quantization,transformers"

RANK = """
import importlib, warnings
warnings.simplefilter("ignore")
for name in {modules!r}.split(","):
    importlib.import_module(name)
import torch
assert float(torch.ones(8).sum()) == 8.0
"""

ZYGOTE = """
import importlib, os, warnings
warnings.simplefilter("ignore")
for name in {modules!r}.split(","):
    importlib.import_module(name)
import torch
pids = []
for rank in range({nprocs}):
    pid = os.fork()
    if pid == 0:
        os._exit(0 if float(torch.ones(8).sum()) == 8.0 else 1)
    pids.append(pid)
codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
raise SystemExit(max(codes))
"""


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONWARNINGS": "ignore"}


def spawned(modules: str, nprocs: int) -> float:
    t = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, "-c", RANK.format(modules=modules)], cwd=REPO_ROOT, env=_env())
             for _ in range(nprocs)]
    codes = [p.wait() for p in procs]
    wall = time.perf_counter() - t
    if any(codes):
        raise RuntimeError(f"spawned ranks exited {codes}")
    return wall


def forked(modules: str, nprocs: int) -> float:
    t = time.perf_counter()
    code = subprocess.run([sys.executable, "-c", ZYGOTE.format(modules=modules, nprocs=nprocs)], cwd=REPO_ROOT,
                          env=_env()).returncode
    wall = time.perf_counter() - t
    if code:
        raise RuntimeError(f"the forking interpreter exited {code}")
    return wall


TINY_EXAMPLE = "examples/tiny/Qwen3-MoE-tiny/megatron_lm_ptq.yaml"


def pipeline(rank_start: str, runs_root: str) -> dict:
    """One ``launch`` of the tiny example with ``executor.rank_start=rank_start``: wall, stage seconds,
    the export's file hashes."""
    from launcher.rundir import file_sha256

    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "launcher.cli", TINY_EXAMPLE, f"runs_root={runs_root}",
                           f"executor.rank_start={rank_start}", "stages.vllm_smoke.enabled=false"],
                          cwd=REPO_ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
    wall = time.perf_counter() - t
    if proc.returncode:
        raise RuntimeError(f"launch with rank_start={rank_start} exited {proc.returncode}:\n{proc.stdout[-3000:]}")
    run_dir = proc.stdout.split("[launch] run directory: ")[1].split("\n")[0].strip()
    hf = os.path.join(run_dir, "export", "hf")
    stages = read_stage_figures(run_dir)
    return {"wall_s": wall, "run_dir": run_dir,
            "export_sha256": {name: file_sha256(os.path.join(hf, name)) for name in sorted(os.listdir(hf))},
            "stage_s": {k: v["wall_s"] for k, v in stages.items() if v["status"] == "completed"}}


def compare_pipelines(repeats: int) -> dict:
    import tempfile

    runs: dict[str, list[dict]] = {"spawn": [], "auto": []}
    with tempfile.TemporaryDirectory(prefix="rank-start-") as tmp:
        for i in range(repeats):   # interleaved, as above
            for way in runs:
                runs[way].append(pipeline(way, os.path.join(tmp, way)))
                log(f"[rank-startup] pipeline {i + 1}/{repeats} rank_start={way}: {runs[way][-1]['wall_s']:.1f} s "
                    f"({', '.join(f'{k} {v:.1f}' for k, v in runs[way][-1]['stage_s'].items())})")
    exports = {way: {tuple(sorted(r["export_sha256"].items())) for r in rs} for way, rs in runs.items()}
    if len(exports["spawn"] | exports["auto"]) != 1:
        raise RuntimeError(f"the exports differ between rank starts: {exports}")
    med = {way: statistics.median(r["wall_s"] for r in rs) for way, rs in runs.items()}
    stage_med = {way: {k: statistics.median(r["stage_s"][k] for r in rs) for k in rs[0]["stage_s"]}
                 for way, rs in runs.items()}
    rows = [[way, f"{med[way]:.1f}", ", ".join(f"{k} {v:.1f}" for k, v in stage_med[way].items())] for way in runs]
    print(markdown_table(["executor.rank_start", "median wall s", "median stage s"], rows))
    ratio = med["spawn"] / med["auto"]
    print(f"launch of the tiny example: spawn/auto = {ratio:.2f}x (exports identical: "
          f"{len(runs['spawn'][0]['export_sha256'])} files)")
    return {"repeats": repeats, "walls_s": {w: [r["wall_s"] for r in rs] for w, rs in runs.items()},
            "median_s": med, "stage_median_s": stage_med, "spawn_over_auto": ratio,
            "export_sha256": runs["auto"][0]["export_sha256"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nprocs", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--modules", default=MODULES)
    ap.add_argument("--pipeline", type=int, default=0, metavar="N",
                    help="also launch the tiny example N times with each executor.rank_start")
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    args = ap.parse_args(argv)
    if args.nprocs < 1 or args.repeats < 1 or args.pipeline < 0:
        raise SystemExit(f"--nprocs and --repeats must be >= 1 and --pipeline >= 0, got {args.nprocs}, "
                         f"{args.repeats} and {args.pipeline}")

    load_start = os.getloadavg()
    walls: dict[str, list[float]] = {"spawned": [], "forked": [], "one": []}
    for i in range(args.repeats):   # interleaved, so a change in the machine's load hits every way alike
        walls["spawned"].append(spawned(args.modules, args.nprocs))
        walls["forked"].append(forked(args.modules, args.nprocs))
        walls["one"].append(spawned(args.modules, 1))
        log(f"[rank-startup] repeat {i + 1}/{args.repeats}: " + ", ".join(f"{k} {v[-1]:.1f} s" for k, v in walls.items()))
    med = {k: statistics.median(v) for k, v in walls.items()}
    ratio = med["spawned"] / med["forked"]
    rows = [[k, f"{med[k]:.2f}", ", ".join(f"{w:.2f}" for w in walls[k])] for k in ("spawned", "forked", "one")]
    print(markdown_table(["way", "median s", "runs s"], rows))
    print(f"{args.nprocs} ranks on {os.cpu_count()} cores: spawned/forked = {ratio:.2f}x "
          f"(saves {med['spawned'] - med['forked']:.1f} s per stage start)")
    pipelines = compare_pipelines(args.pipeline) if args.pipeline else None
    if args.out:
        write_json(args.out, {"nprocs": args.nprocs, "cores": os.cpu_count(), "modules": args.modules.split(","),
                              "repeats": args.repeats, "walls_s": walls, "median_s": med,
                              "spawned_over_forked": ratio, "pipeline": pipelines, "loadavg_start": load_start,
                              "loadavg_end": os.getloadavg()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
