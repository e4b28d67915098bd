"""What a stage's code gets on each rank: the resolved config, its directories, its rank grid.

Stage modules expose ``run(ctx: StageContext) -> None``; they raise ``StageFailed`` (or any
exception) to fail, and write their outputs under ``ctx.stage_dir`` through a temporary name
renamed into place (``atomic_dir`` / ``write_json_atomic``).
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from typing import Any, Iterator

from omegaconf import DictConfig

from launcher.topology import ParallelDims

# Exit codes of a worker process (the executors report them).
EXIT_OK = 0
EXIT_FAILED = 1
EXIT_GATE_FAILED = 3      # the MMLU gate decided "fail" (every rank exits with it)
EXIT_DESYNC = 4           # the desync guard tripped
EXIT_PREFLIGHT = 5        # group check failed before the stage started


class StageFailed(RuntimeError):
    """A stage decided the run must fail; ``exit_code`` is what every rank exits with."""

    def __init__(self, message: str, exit_code: int = EXIT_FAILED):
        super().__init__(message)
        self.exit_code = exit_code


@dataclass
class StageContext:
    name: str                 # quantize | mmlu | export | vllm_smoke
    cfg: DictConfig           # the whole resolved pipeline config
    run_dir: str
    rank: int
    world_size: int
    local_rank: int
    dims: ParallelDims
    device: str               # "cpu" or "cuda"

    @property
    def stage_cfg(self) -> DictConfig:
        return self.cfg.stages[self.name]

    @property
    def stage_dir(self) -> str:
        return os.path.join(self.run_dir, self.name)

    def path(self, stage: str, *parts: str) -> str:
        """A path inside another stage's directory (e.g. ctx.path("quantize", "checkpoint"))."""
        return os.path.join(self.run_dir, stage, *parts)

    def log(self, msg: str, all_ranks: bool = False) -> None:
        """Progress line on stdout (the executor tees it to <stage>/log.txt and the console)."""
        if all_ranks or self.rank == 0:
            print(f"[{self.name} r{self.rank} {time.strftime('%H:%M:%S')}] {msg}", flush=True)

    def warn(self, msg: str) -> None:
        if self.rank == 0:
            print(f"[{self.name} WARNING] {msg}", file=sys.stderr, flush=True)


def write_json_atomic(path: str, data: Any) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2, sort_keys=False, default=str)
        f.write("\n")
    os.replace(tmp, path)


@contextlib.contextmanager
def atomic_dir(final: str, overwrite: bool = False) -> Iterator[str]:
    """Yield a temporary directory next to ``final``; rename it into place on success.

    Single-process helper (call it on one rank, or give every rank the same decision).  An
    interrupted write leaves only ``<final>.tmp-*``, never a partial ``final``.
    """
    if os.path.exists(final) and not overwrite:
        raise StageFailed(f"{final} exists; refusing to overwrite (set overwrite=true to replace it)")
    tmp = f"{final}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if os.path.exists(final):
        shutil.rmtree(final)
    os.replace(tmp, final)
