"""What a stage's code gets on each rank: the resolved config, its directories, its rank grid.

Stage modules expose ``run(ctx: StageContext) -> None``; they raise ``StageFailed`` (or any
exception) to fail, and write their outputs under ``ctx.stage_dir`` through a temporary name
renamed into place (``atomic_dir`` / ``write_json_atomic``, from launcher.contract).
"""
from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass

from omegaconf import DictConfig

# the shared vocabulary, re-exported for the stage modules: StageFailed, the atomic writers
from launcher.contract import RunLayout, StageFailed, atomic_dir, write_json_atomic  # noqa: F401
from launcher.topology import ParallelDims


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

    @property
    def layout(self) -> RunLayout:
        """Every shared path of the run directory (quantize checkpoint, mmlu results, ...)."""
        return RunLayout(self.run_dir)

    def log(self, msg: str, all_ranks: bool = False) -> None:
        """Progress line on stdout (the executor tees it to <stage>/log.txt and the console)."""
        if all_ranks or self.rank == 0:
            print(f"[{self.name} r{self.rank} {time.strftime('%H:%M:%S')}] {msg}", flush=True)

    def warn(self, msg: str) -> None:
        if self.rank == 0:
            print(f"[{self.name} WARNING] {msg}", file=sys.stderr, flush=True)

