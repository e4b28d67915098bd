"""`python -m launcher_testing.tiny [--model NAME|all] [--out DIR] [--force] [--steps N] [--background]`: build
(or reuse) a tiny model, print its directory (one line per model).

``--background`` (one model, the default directory): a current build is printed at once; otherwise the
build runs in a detached process (its log: ``<cache_dir()>/tiny/.NAME.build.log``) and this command
returns as soon as that process holds the build's lock.  Whoever then asks for the model
(``ensure_tiny_model``: a test's fixture) waits on the lock and gets the finished build, so
``make test`` runs its other tests beside the build (about 10 min on one core for NemotronH-MoE-tiny).
"""
from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
import time
from pathlib import Path

from launcher_testing.locked_build import holds_lock, lock_path
from launcher_testing.tiny.build import MODEL_NAME, TINY_MODELS, default_dir, ensure_tiny_model, is_current
from launcher_testing.tiny.train import Recipe

LOCK_WAIT_S = 300.0   # the detached builder imports torch and transformers before it takes the lock


def start_in_background(target: Path, recipe: Recipe, builder: list[str], log: Path,
                        wait_s: float = LOCK_WAIT_S) -> int:
    """Run ``builder`` (a command that builds ``recipe`` into ``target`` with ``ensure_tiny_model``)
    detached, its output to ``log``, unless the build is current; 0 once the builder holds the build's
    lock (or the build is current), 1 if the builder ended without a current build or never took the lock."""
    if is_current(target, recipe):
        print(target, flush=True)
        return 0
    lock = lock_path(target)
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        proc = subprocess.Popen(builder, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if holds_lock(lock):
            print(f"[tiny] building {target.name} in the background (pid {proc.pid}, log {log}); "
                  f"ensure_tiny_model waits for it", flush=True)
            return 0
        if proc.poll() is not None:
            if is_current(target, recipe):
                print(target, flush=True)
                return 0
            print(f"error: the background build of {target.name} exited with {proc.returncode}; see {log}",
                  file=sys.stderr)
            return 1
        time.sleep(0.1)
    print(f"error: the background build of {target.name} (pid {proc.pid}) did not take its lock {lock} in "
          f"{wait_s:.0f} s; see {log}", file=sys.stderr)
    return 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m launcher_testing.tiny", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=MODEL_NAME, choices=sorted(TINY_MODELS) + ["all"],
                   help=f"which tiny model (default {MODEL_NAME}; all: every one)")
    p.add_argument("--out", help="build directory (default: <cache_dir()>/tiny/<model>; one model only)")
    p.add_argument("--force", action="store_true", help="rebuild even when a current build exists")
    p.add_argument("--steps", type=int, help="override the training steps (changes the recipe hash)")
    p.add_argument("--background", action="store_true",
                   help="build in a detached process, return once it holds the build's lock (one model, "
                        "its default directory and recipe)")
    args = p.parse_args(argv)
    names = sorted(TINY_MODELS) if args.model == "all" else [args.model]
    if args.out and len(names) > 1:
        p.error("--out builds one model: name it with --model")
    if args.background:
        if len(names) > 1 or args.out or args.force or args.steps is not None:
            p.error("--background builds one model (--model NAME) in its default directory with its recipe: "
                    "no --out, --force or --steps")
        target = default_dir(name=names[0])
        return start_in_background(target, TINY_MODELS[names[0]],
                                   [sys.executable, "-m", "launcher_testing.tiny", "--model", names[0]],
                                   target.parent / f".{names[0]}.build.log")
    try:
        for name in names:
            recipe = TINY_MODELS[name]
            if args.steps is not None:
                recipe = dataclasses.replace(recipe, steps=args.steps)
            print(ensure_tiny_model(name=name, out_dir=args.out, recipe=recipe, force=args.force), flush=True)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
