"""What the pipeline hands an executor (one ``StagePlan`` per stage to run, in order), what it
gets back (one ``StageResult`` per stage) and the ``Executor`` protocol (run / cancel / describe)
that the local and the Slurm executor implement, so that the pipeline has one loop for both."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Optional, Protocol

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


@dataclass
class StageResult:
    name: str
    state: str                    # a JobState word (Slurm's own word for the Slurm executor)
    exit_code: int
    duration_s: Optional[float] = None   # measured by the local executor; None under Slurm
    reason: str = ""              # the executor's own account of a failure (Slurm: "Slurm state ...")
    errors: list[str] = field(default_factory=list)   # which task, node or rank failed
    interrupted: bool = False     # Ctrl-C stopped it: the pipeline runs nothing after it


class Progress(Protocol):
    def __call__(self, stage: str, message: str, **fields) -> None:
        """Print ``[launch] STAGE: MESSAGE``; with fields, record them in the stage's metadata."""


class Executor(Protocol):
    # True when the executor itself stops (and reports) the stages after a failed one (Slurm's
    # afterok dependencies); False when the pipeline must stop handing it stages.
    chains_failures: bool
    detached: bool                # run() submitted and returned without following

    def run(self, plans: list[StagePlan], progress: Progress, preflight_only: bool = False,
            detach: bool = False) -> Iterator[StageResult]:
        """Run the plans in order; yields one result per plan, in plan order."""

    def cancel(self) -> None:
        """Stop what run() started (Ctrl-C)."""

    def describe(self, plan: StagePlan) -> list[str]:
        """The command the dry run shows for this plan."""
