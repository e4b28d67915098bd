"""`python -m launcher_testing.tiny [--model NAME|all] [--out DIR] [--force] [--steps N]`: build (or reuse)
a tiny model, print its directory (one line per model)."""
from __future__ import annotations

import argparse
import dataclasses
import sys

from launcher_testing.tiny.build import MODEL_NAME, TINY_MODELS, ensure_tiny_model


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m launcher_testing.tiny", description=__doc__)
    p.add_argument("--model", default=MODEL_NAME, choices=sorted(TINY_MODELS) + ["all"],
                   help=f"which tiny model (default {MODEL_NAME}; all: every one)")
    p.add_argument("--out", help="build directory (default: <cache_dir()>/tiny/<model>; one model only)")
    p.add_argument("--force", action="store_true", help="rebuild even when a current build exists")
    p.add_argument("--steps", type=int, help="override the training steps (changes the recipe hash)")
    args = p.parse_args(argv)
    names = sorted(TINY_MODELS) if args.model == "all" else [args.model]
    if args.out and len(names) > 1:
        p.error("--out builds one model: name it with --model")
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
