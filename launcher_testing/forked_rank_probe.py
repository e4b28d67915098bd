"""A rank body for tests/test_rank_start.py: starts a multiprocessing child that would outlive it, writes
the child's pid to ``argv[0]``, then fails with exit code 3 (the way a stage fails with writers running)."""
from __future__ import annotations

import multiprocessing
import time


def _linger() -> None:
    time.sleep(120)


def main(argv: list[str]) -> int:
    child = multiprocessing.get_context("fork").Process(target=_linger, daemon=False)
    child.start()
    with open(argv[0], "w") as f:
        f.write(str(child.pid))
    return 3
