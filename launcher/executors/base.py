"""What the pipeline hands an executor: one ``StagePlan`` per stage to run, in order."""
from __future__ import annotations

from dataclasses import dataclass, field

from launcher.contract import JobState


@dataclass
class StagePlan:
    name: str                     # quantize | mmlu | export | vllm_smoke
    world_size: int               # number of ranks
    argv: list[str]               # what every rank runs, e.g. [python, "-m", "launcher.worker", name, run_dir]
    env: dict[str, str] = field(default_factory=dict)  # extra environment for every rank
    log_path: str = ""            # <run_dir>/<name>/log.txt
    allow_to_fail: bool = False   # the pipeline continues after this stage fails


# Final job states as Slurm names them; the local executor reports the same words (launcher.contract).
COMPLETED, FAILED, CANCELLED, TIMEOUT = JobState.COMPLETED, JobState.FAILED, JobState.CANCELLED, JobState.TIMEOUT
