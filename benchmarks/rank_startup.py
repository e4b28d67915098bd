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

It prints the median of each, the ratio spawned/forked and the cores this machine has.  The forked way is
a measurement of what a zygote start would save, not the product's start (the product spawns).
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._common import REPO_ROOT, log, markdown_table, write_json  # noqa: E402

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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nprocs", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--modules", default=MODULES)
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    args = ap.parse_args(argv)
    if args.nprocs < 1 or args.repeats < 1:
        raise SystemExit(f"--nprocs and --repeats must be >= 1, got {args.nprocs} and {args.repeats}")

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
    if args.out:
        write_json(args.out, {"nprocs": args.nprocs, "cores": os.cpu_count(), "modules": args.modules.split(","),
                              "repeats": args.repeats, "walls_s": walls, "median_s": med,
                              "spawned_over_forked": ratio, "loadavg_start": load_start,
                              "loadavg_end": os.getloadavg()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
