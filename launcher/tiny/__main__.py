"""`python -m launcher.tiny [--out DIR] [--force] [--steps N]`: build (or reuse) the tiny model, print its directory."""
from __future__ import annotations

import argparse
import dataclasses
import sys

from launcher.tiny.build import ensure_tiny_model
from launcher.tiny.train import Recipe


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m launcher.tiny", description=__doc__)
    p.add_argument("--out", help="build directory (default: <cache_dir()>/tiny/Qwen3-MoE-tiny)")
    p.add_argument("--force", action="store_true", help="rebuild even when a current build exists")
    p.add_argument("--steps", type=int, help="override the training steps (changes the recipe hash)")
    args = p.parse_args(argv)
    recipe = Recipe()
    if args.steps is not None:
        recipe = dataclasses.replace(recipe, steps=args.steps)
    try:
        path = ensure_tiny_model(out_dir=args.out, recipe=recipe, force=args.force)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
