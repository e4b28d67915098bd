"""Job state from Slurm's own words: parse ``scontrol show job -o`` (pure functions, no I/O).

``scontrol show job -o ID`` prints one line of ``Key=Value`` pairs; values may contain spaces
(``Command=``, ``WorkDir=``, ``Comment=``), so a token only starts a new pair when it looks like
``Key=``.  ``scontrol`` keeps ended jobs for ``MinJobAge`` seconds (300 by default) - longer than
our poll interval, and unlike ``sacct`` it needs no accounting daemon
(tests/slurm_cluster.py runs none).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional

from launcher.contract import JobState

# Slurm job states (squeue(1) "JOB STATE CODES").  A job in a final state will not run again.
FINAL_STATES = frozenset({
    "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY",
    "BOOT_FAIL", "DEADLINE", "SPECIAL_EXIT", "REVOKED",
})
ACTIVE_STATES = frozenset({
    "PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "REQUEUE_HOLD",
    "REQUEUE_FED", "RESIZING", "SIGNALING", "STAGE_OUT", "STOPPED", "RESV_DEL_HOLD",
})
SUCCESS_STATE = JobState.COMPLETED
# A pending job that can never start because a dependency ended the wrong way.  Without
# DependencyParameters=kill_invalid_depend it would wait in the queue forever: the executor
# cancels it and reports CANCELLED with this reason.
NEVER_SATISFIED = "DependencyNeverSatisfied"
UNKNOWN = JobState.UNKNOWN   # the controller no longer knows the job (older than MinJobAge, or purged)

_KEY = re.compile(r"^[A-Za-z][A-Za-z0-9_/:]*=")


def parse_scontrol_line(line: str) -> dict[str, str]:
    """``Key=Value Key2=Value with spaces`` -> {"Key": "Value", "Key2": "Value with spaces"}."""
    out: dict[str, str] = {}
    key: Optional[str] = None
    for tok in line.strip().split(" "):
        if _KEY.match(tok):
            key, _, value = tok.partition("=")
            out[key] = value
        elif key is not None:
            out[key] += " " + tok
    return out


def parse_scontrol_jobs(text: str) -> dict[str, dict[str, str]]:
    """Output of ``scontrol show job -o [ID]`` (one job per line) -> {job id: fields}."""
    jobs = {}
    for line in text.splitlines():
        if "JobId=" not in line:
            continue
        fields = parse_scontrol_line(line)
        if "JobId" in fields:
            jobs[fields["JobId"]] = fields
    return jobs


def _null(v: Optional[str]) -> Optional[str]:
    return None if v in (None, "", "(null)", "None", "Unknown", "N/A") else v


@dataclass
class JobInfo:
    """What the executor reports about one job."""

    job_id: str
    state: str                        # exactly Slurm's JobState (COMPLETED, FAILED, CANCELLED, TIMEOUT...)
    reason: Optional[str] = None      # Slurm's Reason (NonZeroExitCode, Dependency, DependencyNeverSatisfied...)
    exit_code: Optional[int] = None   # the batch script's exit status (first half of ExitCode=3:0)
    signal: Optional[int] = None      # the signal that ended it (second half; 15 for a cancel)
    node_list: Optional[str] = None
    submit_time: Optional[str] = None
    start_time: Optional[str] = None
    end_time: Optional[str] = None
    run_time: Optional[str] = None
    time_limit: Optional[str] = None
    raw: dict = field(default_factory=dict, repr=False)

    @property
    def final(self) -> bool:
        return self.state in FINAL_STATES

    @property
    def never_satisfied(self) -> bool:
        return self.state == "PENDING" and self.reason == NEVER_SATISFIED

    def as_dict(self) -> dict:
        d = {k: getattr(self, k) for k in ("job_id", "state", "reason", "exit_code", "signal", "node_list",
                                           "submit_time", "start_time", "end_time", "run_time", "time_limit")}
        return d


def job_info(fields: dict[str, str]) -> JobInfo:
    """Fields of one ``scontrol show job -o`` line -> JobInfo."""
    state = fields.get("JobState", UNKNOWN)
    # "CANCELLED by 0" appears in sacct, not in scontrol; be strict anyway: first word only
    state = state.split()[0] if state else UNKNOWN
    exit_code = sig = None
    ec = fields.get("ExitCode")
    if ec and ":" in ec:
        a, _, b = ec.partition(":")
        if a.isdigit() and b.isdigit():
            exit_code, sig = int(a), int(b)
    start_time = _null(fields.get("StartTime"))
    # A job that never started has no run time.  Slurm's RunTime for a job cancelled while pending
    # is sometimes 00:00:00 and sometimes now minus the epoch ("20792-08:24:39", seen in CI).
    run_time = _null(fields.get("RunTime")) if start_time else None
    return JobInfo(
        job_id=fields.get("JobId", ""),
        state=state,
        reason=_null(fields.get("Reason")),
        exit_code=exit_code,
        signal=sig,
        node_list=_null(fields.get("NodeList")),
        submit_time=_null(fields.get("SubmitTime")),
        start_time=start_time,
        end_time=_null(fields.get("EndTime")),
        run_time=run_time,
        time_limit=_null(fields.get("TimeLimit")),
        raw=fields,
    )


def parse_sbatch_parsable(stdout: str) -> str:
    """``sbatch --parsable`` prints ``jobid`` or ``jobid;cluster`` -> jobid."""
    line = stdout.strip().splitlines()[-1] if stdout.strip() else ""
    job_id = line.split(";")[0].strip()
    if not job_id.isdigit():
        raise ValueError(f"unexpected sbatch output: {stdout!r}")
    return job_id


def is_invalid_job_error(stderr: str) -> bool:
    """scontrol's answer for a job id the controller does not (or no longer) know."""
    return "Invalid job id" in stderr


# Lines of a stage's log that say what failed and where, in three tiers, most telling first:
#   0  where it broke: srun naming a task killed by a signal ("srun: error: node02: task 3: Killed")
#      or a launch that failed on a node, slurmstepd's "*** ... DUE TO NODE FAILURE/TIME LIMIT ***"
#   1  a rank's own verdict ("[mmlu r2] STAGE FAILED: ... desync guard: ranks [0, 1, 2, 3] ...")
#   2  consequences: tasks that exited non-zero, a rank that lost its peer's connection, a step
#      cancelled because another task died
# Log order alone does not put the cause first: srun prints "task 3: Killed" for the SIGKILLed rank
# after the surviving ranks' errors whenever they fail first on the broken connection.
FAILURE_LINE = re.compile(r"^(srun: error: |slurmstepd\S*: error: \*\*\* |\[\w+ r\d+\] (STAGE|PREFLIGHT) FAILED)")
_EXITED = re.compile(r"^srun: error: \S+: tasks? [\d,-]+: Exited with exit code")
_SLURMSTEPD_CAUSE = re.compile(r"DUE TO (NODE FAILURE|TIME LIMIT|PREEMPTION)")
_PEER_LOST = re.compile(r"Connection (closed|reset) by peer|remote worker (crashing|hanging)")


def _failure_tier(line: str) -> int:
    if line.startswith("srun: error: "):
        return 2 if _EXITED.match(line) else 0
    if line.startswith("slurmstepd"):
        return 0 if _SLURMSTEPD_CAUSE.search(line) else 2
    return 2 if _PEER_LOST.search(line) else 1


def failure_lines_of_log(text: str, limit: int = 4, width: int = 300) -> list[str]:
    """The first ``limit`` distinct FAILURE_LINE lines of ``text`` (each cut to ``width``
    characters), causes before consequences (the tiers above), log order within a tier."""
    assert limit > 0, limit
    found: list[str] = []
    for line in text.splitlines():
        line = line.strip()[:width]
        if FAILURE_LINE.match(line) and line not in found:
            found.append(line)
    return sorted(found, key=_failure_tier)[:limit]   # sorted() is stable: log order within a tier
