"""Slurm executor: one sbatch job per stage, chained by job dependencies; state read from Slurm.

Submission is plain ``sbatch --parsable`` and state is ``scontrol show job -o`` - no client
library.  submitit (tried with this project's local Slurm) pickles a Python callable and polls
``sacct``: our stages are already a command line (``python -m launcher.worker STAGE RUN_DIR``), we
need the script itself rendered by a pure, golden-tested function, and without slurmdbd ``sacct``
fails, so submitit waits forever on a job cancelled from outside.  ``scontrol`` answers for every
job the controller remembers (``MinJobAge``, 300 s by default) on every cluster, with or without
accounting, and gives state, reason and exit code - everything we report.

Per stage the executor writes ``<run_dir>/slurm/<stage>.sbatch`` (see slurm_script.py), submits
it with ``--dependency`` on the stages before it (``afterok``; ``afterany`` after a stage that may
fail, plus ``afterok`` on the last stage that may not) and ``--kill-on-invalid-dep=yes`` (Slurm
itself cancels a dependant that can never start, even when nobody follows), and records every job in
``<run_dir>/slurm/jobs.json``.  ``follow`` polls the jobs, calls ``on_state`` on every change,
tails each stage's log to the console, cancels dependants that can never start
(``DependencyNeverSatisfied``) so nothing lingers, and returns each stage's final state -
exactly Slurm's word: COMPLETED, FAILED, CANCELLED, TIMEOUT, OUT_OF_MEMORY, NODE_FAIL, ...
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Optional, Sequence

from launcher.contract import EXIT_REASONS, JobState, RunLayout, StageStatus, split_secrets, write_json_atomic
from launcher.executors.base import Progress, StagePlan, StageResult
from launcher.executors.slurm_script import dependency_spec, render_sbatch, stage_env
from launcher.executors.slurm_state import (
    FINAL_STATES,
    UNKNOWN,
    JobInfo,
    failure_lines_of_log,
    is_invalid_job_error,
    job_info,
    parse_sbatch_parsable,
    parse_scontrol_jobs,
)

if TYPE_CHECKING:   # a DictConfig merged onto it (compose, the worker) or the dataclass
    from launcher.schema import SlurmExecutorConfig

INSTALL_HINT = ("install the Slurm client tools (Debian/Ubuntu: `apt-get install slurm-client`, or "
                "`module load slurm` on your cluster) or run with executor=local")
# a job the controller has forgotten (older than MinJobAge) is reported UNKNOWN after this many polls
UNKNOWN_AFTER_POLLS = 3
# how long scontrol may keep failing (controller down or restarting) before follow gives up
CONTROLLER_GRACE_S = 120.0

OnState = Callable[[str, str, dict], None]


class SlurmError(RuntimeError):
    """A Slurm command failed; the message says which, with its output."""


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise SlurmError(f"`{name}` not found on PATH: {INSTALL_HINT}")
    return path


def _client_env(extra: Optional[dict[str, str]] = None) -> dict[str, str]:
    """os.environ without inherited SLURM_* job variables (launching from inside an allocation
    must not leak SLURM_NTASKS & co. into the new jobs), plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") or k == "SLURM_CONF"}
    env.update(extra or {})
    return env


def _run(argv: list[str], env: Optional[dict[str, str]] = None, timeout: float = 60) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(argv, env=env or _client_env(), capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError:
        raise SlurmError(f"`{argv[0]}` not found: {INSTALL_HINT}") from None
    except subprocess.TimeoutExpired as e:
        raise SlurmError(f"`{' '.join(argv)}` did not answer within {timeout:.0f} s") from e


def query_jobs(job_ids: Iterable[str]) -> dict[str, Optional[JobInfo]]:
    """Current state of each job from ``scontrol show job -o ID``; None for a job Slurm no longer knows.

    Raises SlurmError when scontrol itself fails (controller unreachable).
    """
    scontrol = _tool("scontrol")
    out: dict[str, Optional[JobInfo]] = {}
    for jid in job_ids:
        r = _run([scontrol, "show", "job", "-o", str(jid)], timeout=30)
        if r.returncode != 0:
            if is_invalid_job_error(r.stderr):
                out[jid] = None
                continue
            raise SlurmError(f"scontrol show job {jid} failed (exit {r.returncode}): {r.stderr.strip()}")
        jobs = parse_scontrol_jobs(r.stdout)
        out[jid] = job_info(jobs[jid]) if jid in jobs else None
    return out


def unhealthy_nodes(node_list: str) -> list[str]:
    """``node node02: down* (Not responding)`` for each node of ``node_list`` that slurmctld holds
    down, drained, failing or not responding (``*``); [] when all are fine or sinfo cannot tell."""
    if not node_list:
        return []
    try:
        r = _run([_tool("sinfo"), "-h", "-N", "-n", node_list, "-o", "%N|%T|%E"], timeout=30)
    except SlurmError:
        return []
    out = []
    for line in r.stdout.splitlines():
        name, state, reason = (line.strip().split("|", 2) + ["", ""])[:3]
        if state.endswith("*") or state.startswith(("down", "drain", "fail")):
            note = f" ({reason})" if reason and reason.lower() != "none" else ""
            out.append(f"node {name}: {state}{note}")
    return sorted(set(out))


def scancel(job_ids: Sequence[str]) -> subprocess.CompletedProcess:
    """Cancel jobs (dependants first, so none of them starts in between); errors for jobs that
    already ended are ignored."""
    return _run([_tool("scancel"), *[str(j) for j in reversed(list(job_ids))]], timeout=60)


class SlurmExecutor:
    """Run a pipeline's stages as chained sbatch jobs.  ``cfg``: a SlurmExecutorConfig (DictConfig
    or dataclass); ``run_dir``: the run directory (scripts and jobs.json go to ``run_dir/slurm``)."""

    chains_failures = True   # afterok dependencies: Slurm cancels what comes after a failed stage

    def __init__(self, cfg: SlurmExecutorConfig, run_dir: str, echo: Optional[Callable[[str], None]] = None):
        self.cfg = cfg
        self.run_dir = os.path.abspath(run_dir)
        self.slurm_dir = RunLayout(self.run_dir).slurm_dir
        self.jobs_path = RunLayout(self.run_dir).slurm_jobs
        self.echo = echo if echo is not None else (lambda line: print(line, flush=True))
        self.poll_interval_s = float(cfg.poll_interval_s)
        self._record: Optional[dict] = None
        self._job_ids: list[str] = []
        self.detached = False

    # ------------------------------------------------------------------ the Executor protocol
    def run(self, plans: list[StagePlan], progress: Progress, preflight_only: bool = False,
            detach: bool = False) -> Iterator[StageResult]:
        """Submit every plan, then (unless ``detach``) follow the jobs to their ends and yield each
        stage's result.  Ctrl-C while following propagates (the pipeline calls ``cancel``)."""
        self._job_ids = job_ids = self.submit(plans)
        for plan, job in zip(plans, job_ids):
            progress(plan.name, f"submitted as Slurm job {job}", status=StageStatus.SUBMITTED, job_id=job)
        if detach:
            self.detached = True
            return

        def on_state(stage: str, state: str, info: dict) -> None:
            fields = {"status": StageStatus.RUNNING} if state == JobState.RUNNING else {}
            progress(stage, f"{state} {info.get('reason', '') or ''}".rstrip(), **fields)

        finals = self.follow(job_ids, on_state)
        for plan in plans:
            state = finals.get(plan.name, JobState.UNKNOWN)
            if state == JobState.COMPLETED:
                yield StageResult(plan.name, state, 0)
                continue
            code = int(self.job_info(plan.name).get("exit_code") or 1)
            reason = f"Slurm state {state}" + (f": {EXIT_REASONS[code]}" if code in EXIT_REASONS else "")
            # which task, node or rank failed, from the log
            yield StageResult(plan.name, state, code, reason=reason, errors=self.failure_lines(plan.name))

    def describe(self, plan: StagePlan) -> list[str]:
        return ["sbatch <<'EOF'\n" + render_sbatch(plan, self.cfg, self.run_dir) + "EOF"]

    # ------------------------------------------------------------------ submit
    def submit(self, plans: list[StagePlan]) -> list[str]:
        """Submit one job per plan, in order, each depending on the ones before; returns job ids.

        If a submission fails, the jobs already submitted are cancelled and SlurmError says why.
        """
        sbatch = _tool("sbatch")
        os.makedirs(self.slurm_dir, exist_ok=True)
        previous = None
        if os.path.exists(self.jobs_path):  # a resumed run: keep the earlier submission's record
            with open(self.jobs_path) as f:
                previous = json.load(f)
        record: dict[str, Any] = {"run_dir": self.run_dir, "stages": {}, "order": []}
        if previous:
            record["previous"] = previous.get("previous", []) + [{k: v for k, v in previous.items() if k != "previous"}]
        ids: list[str] = []
        for i, plan in enumerate(plans):
            script = render_sbatch(plan, self.cfg, self.run_dir)
            path = os.path.join(self.slurm_dir, f"{plan.name}.sbatch")
            with open(path, "w") as f:
                f.write(script)
            os.makedirs(os.path.dirname(os.path.abspath(plan.log_path)), exist_ok=True)
            log_offset = os.path.getsize(plan.log_path) if os.path.exists(plan.log_path) else 0
            dep = dependency_spec(i, plans, ids)
            argv = [sbatch, "--parsable", "--kill-on-invalid-dep=yes"]
            if dep:
                argv.append(f"--dependency={dep}")
            argv.append(path)
            _, secret = split_secrets(stage_env(plan, self.cfg))
            r = _run(argv, env=_client_env(secret))
            if r.returncode != 0:
                if ids:
                    scancel(ids)
                raise SlurmError(f"sbatch failed for stage {plan.name} (exit {r.returncode}): "
                                 f"{(r.stderr or r.stdout).strip()}\n  script: {path}"
                                 + (f"\n  cancelled the stages submitted before it: {ids}" if ids else ""))
            job_id = parse_sbatch_parsable(r.stdout)
            ids.append(job_id)
            record["order"].append(plan.name)
            record["stages"][plan.name] = {
                "job_id": job_id, "script": path, "log": os.path.abspath(plan.log_path),
                "log_offset": log_offset, "dependency": dep, "allow_to_fail": bool(plan.allow_to_fail),
                "world_size": plan.world_size, "submitted_at": time.time(), "final_state": None,
            }
            write_json_atomic(self.jobs_path, record)   # after each job: a crash still leaves a record
        self._record = record
        return ids

    # ------------------------------------------------------------------ follow
    def _load_record(self) -> dict:
        if self._record is None:
            if not os.path.exists(self.jobs_path):
                raise SlurmError(f"{self.jobs_path} not found: nothing was submitted for this run")
            with open(self.jobs_path) as f:
                self._record = json.load(f)
        return self._record

    def follow(self, job_ids: Sequence[str], on_state: Optional[OnState] = None,
               timeout_s: Optional[float] = None, tail_logs: bool = True) -> dict[str, str]:
        """Poll until every job has a final state; returns {stage: state}.

        ``on_state(stage, state, info)`` is called whenever a job's state or reason changes
        (info: job_id, state, reason, exit_code, signal, node_list, times).  A job pending on a
        dependency that can never be satisfied is cancelled here (if Slurm has not already done
        so) and reported CANCELLED with reason DependencyNeverSatisfied.  With ``timeout_s`` a
        TimeoutError is raised when it passes (the caller decides whether to cancel).
        """
        _tool("scontrol")   # a missing client is an error now, not a "controller down" to wait out
        record = self._load_record()
        by_id = {s["job_id"]: name for name, s in record["stages"].items()}
        stage_of = {jid: by_id.get(jid, jid) for jid in job_ids}
        offsets = {jid: record["stages"].get(stage_of[jid], {}).get("log_offset", 0) for jid in job_ids}
        logs = {jid: record["stages"].get(stage_of[jid], {}).get("log") for jid in job_ids}
        last: dict[str, tuple] = {}
        final: dict[str, JobInfo] = {}
        missing: dict[str, int] = {}
        cancelled_by_us: set[str] = set()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        failing_since: Optional[float] = None
        while True:
            pending = [j for j in job_ids if j not in final]
            try:
                infos = query_jobs(pending)
                failing_since = None
            except SlurmError:
                failing_since = failing_since or time.monotonic()
                if time.monotonic() - failing_since > CONTROLLER_GRACE_S:
                    raise
                infos = {}
            for jid in pending:
                if jid not in infos:
                    continue
                info = infos[jid]
                if info is None:
                    missing[jid] = missing.get(jid, 0) + 1
                    if missing[jid] < UNKNOWN_AFTER_POLLS:
                        continue
                    info = JobInfo(job_id=jid, state=UNKNOWN, reason="job no longer known to slurmctld")
                if info.never_satisfied and jid not in cancelled_by_us:
                    scancel([jid])
                    cancelled_by_us.add(jid)
                if tail_logs and logs.get(jid):
                    offsets[jid] = self._tail(logs[jid], offsets[jid])
                key = (info.state, info.reason)
                if last.get(jid) != key:
                    last[jid] = key
                    if on_state:
                        on_state(stage_of[jid], info.state, {"stage": stage_of[jid], **info.as_dict()})
                if info.final or info.state == UNKNOWN:
                    final[jid] = info
            if len(final) == len(job_ids):
                break
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"Slurm jobs {pending} not finished after {timeout_s:.0f} s")
            time.sleep(self.poll_interval_s)
        result = {stage_of[j]: final[j].state for j in job_ids}
        for jid, info in final.items():
            st = record["stages"].get(stage_of[jid])
            if st is not None:
                st["final_state"] = info.state
                st["final_info"] = info.as_dict()
        if os.path.isdir(self.slurm_dir):
            write_json_atomic(self.jobs_path, record)
        return result

    def _tail(self, path: str, offset: int) -> int:
        """Echo the complete new lines of ``path`` after ``offset``; returns the new offset."""
        try:
            with open(path, "rb") as f:
                f.seek(offset)
                data = f.read()
        except FileNotFoundError:
            return offset
        end = data.rfind(b"\n")
        if end < 0:
            return offset
        for line in data[: end + 1].decode("utf-8", "replace").splitlines():
            self.echo(line)
        return offset + end + 1

    def job_info(self, stage: str) -> dict:
        """The last known info of ``stage``'s job (job_id, state, reason, exit_code, signal, times):
        recorded by ``follow`` when it ended, else live from scontrol; {} if the stage was not submitted."""
        record = self._load_record()
        st = record["stages"].get(stage)
        if st is None:
            return {}
        if st.get("final_info"):
            return {"stage": stage, **st["final_info"]}
        info = query_jobs([st["job_id"]]).get(st["job_id"])
        if info is None:
            return {"stage": stage, "job_id": st["job_id"], "state": UNKNOWN}
        return {"stage": stage, **info.as_dict()}

    def failure_lines(self, stage: str, limit: int = 4) -> list[str]:
        """What failed and where, for a stage that did not complete: the nodes of its job that
        slurmctld now holds down or not responding (``unhealthy_nodes``), then the first ``limit``
        distinct failure lines of this submission's part of the stage's log, causes first
        (``failure_lines_of_log``); [] when there is nothing to say."""
        st = self._load_record()["stages"].get(stage) or {}
        out = unhealthy_nodes((st.get("final_info") or {}).get("node_list") or "")
        try:
            with open(st.get("log") or "", "rb") as f:
                f.seek(int(st.get("log_offset") or 0))
                text = f.read().decode("utf-8", "replace")
        except OSError:
            return out
        return out + failure_lines_of_log(text, limit)

    # ------------------------------------------------------------------ cancel / status
    def cancel(self, job_ids: Optional[Sequence[str]] = None) -> None:
        """scancel the jobs (default: those run() submitted; Ctrl-C in `launch`); jobs that already
        ended are left as they are."""
        job_ids = self._job_ids if job_ids is None else job_ids
        if job_ids:
            scancel(job_ids)

    @staticmethod
    def status_details(run_dir: str) -> dict[str, dict]:
        """{stage: info} for `launch status RUN_DIR`: live from scontrol, else the state recorded
        when the run was followed to its end, else UNKNOWN (the controller forgot the job)."""
        path = RunLayout(os.path.abspath(run_dir)).slurm_jobs
        if not os.path.exists(path):
            raise SlurmError(f"{path} not found: this run was not submitted to Slurm")
        with open(path) as f:
            record = json.load(f)
        order = record.get("order") or list(record["stages"])
        ids = [record["stages"][s]["job_id"] for s in order]
        note = "job no longer known to slurmctld and not recorded as finished"
        try:
            live = query_jobs(ids)
        except SlurmError as e:   # no client here, or the controller is down: report what was recorded
            live, note = {}, f"Slurm not reachable ({e})"
        out: dict[str, dict] = {}
        for stage, jid in zip(order, ids):
            info = live.get(jid)
            if info is not None:
                out[stage] = {"stage": stage, **info.as_dict()}
            elif record["stages"][stage].get("final_info"):
                out[stage] = {"stage": stage, **record["stages"][stage]["final_info"]}
            else:
                out[stage] = {"stage": stage, "job_id": jid, "state": UNKNOWN, "reason": note}
        return out

    @staticmethod
    def status(run_dir: str) -> dict[str, str]:
        """{stage: Slurm state} of a submitted run (see status_details for reasons and exit codes)."""
        return {s: d["state"] for s, d in SlurmExecutor.status_details(run_dir).items()}


def format_state(stage: str, state: str, info: dict) -> str:
    """One console line for an on_state event, e.g. ``[slurm] mmlu FAILED (job 12, exit 3)``."""
    bits = [f"job {info.get('job_id')}"]
    if info.get("reason"):
        bits.append(str(info["reason"]))
    if state in FINAL_STATES and info.get("exit_code") not in (None, 0):
        bits.append(f"exit {info['exit_code']}")
    if state in FINAL_STATES and info.get("signal"):
        bits.append(f"signal {info['signal']}")
    return f"[slurm] {stage} {state} ({', '.join(bits)})"


if __name__ == "__main__":  # `python -m launcher.executors.slurm status RUN_DIR` (debug aid)
    if len(sys.argv) == 3 and sys.argv[1] == "status":
        for s, d in SlurmExecutor.status_details(sys.argv[2]).items():
            print(format_state(s, d["state"], d))
    else:
        print("usage: python -m launcher.executors.slurm status RUN_DIR", file=sys.stderr)
        sys.exit(2)
