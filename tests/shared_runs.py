"""Runs shared by the whole pytest session, used copy-on-write (registered by tests/conftest.py).

``tiny_run``: ONE tiny pipeline run (the embedded default, NVFP4, 4 local gloo ranks), made once
per session the way a user meets a crash:

  1. ``launch`` is started and rank 1 of its quantize stage is SIGKILLed mid-calibration
     (`kill_rank`: only a process of THIS launch's tree, never one found by name);
  2. ``launch --resume`` completes it: quantize, the MMLU gate, export (profiled: PTQ_PROFILE=export),
     vLLM smoke (a skip on CPU).

Both states are kept, read-only: ``killed`` (the run directory as the killed launch left it) and
``completed``.  A test never touches them: it asks for a copy (``copy_killed`` / ``copy_completed``,
a fresh directory each time, laid out as ``<runs_root>/<job_name>/<run_id>`` so that ``launch``
and ``launch suite`` find it) and may then resume or rewrite its copy.  tests/test_pipeline_local.py
(the kill, the resume, the gate failing on a resume) and tests/test_suite.py (the suite's run of the
tiny example resumes a copy) read it; whichever asks first pays for it (about two pipeline runs).

torch-free to import (`make test-fast` imports tests/conftest.py); the fixture needs the tiny model
(the `tiny_dir` fixture: a `torch` test).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_EXAMPLE = os.path.join(ROOT, "examples", "tiny", "Qwen3-MoE-tiny", "megatron_lm_ptq.yaml")


# the shared run's agents and ranks must be its `launch` process's descendants (worker_pids finds them
# there) and tests/test_pipeline_local.py checks the run's own preloaded process: not the session's
# shared one (tests/conftest.py's shared_local_zygote)
OWN_ZYGOTE = {"PTQ_LOCAL_ZYGOTE": "0"}


def launch(*args, env=None, **kw) -> subprocess.Popen:
    """``launch TINY_EXAMPLE *args`` from the repository, stdout and stderr as one text pipe."""
    return subprocess.Popen([sys.executable, "-m", "launcher.cli", TINY_EXAMPLE, *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}, **kw)


def finish(proc: subprocess.Popen, timeout: float = 900) -> tuple[int, str]:
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


def meta(run_dir) -> dict:
    with open(os.path.join(run_dir, "metadata.json")) as f:
        return json.load(f)


def worker_pids(launch_pid: int, stage: str, rank=None) -> list[int]:
    """The pids of `stage`'s worker ranks (one rank if given) among the descendants of `launch_pid`
    (the `launch` process: it starts the local agent, which starts the ranks): other runs on the
    machine (another test session, a user's demo) are never matched.  A rank is told by the name
    the worker gives its process, ``<stage>:r<rank>`` (spawned or forked: a forked rank's command
    line and environment at start are its agent's)."""
    import psutil

    out = []
    try:
        descendants = psutil.Process(launch_pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    for p in descendants:
        try:
            name = p.name()
        except psutil.Error:   # ended meanwhile
            continue
        if name == f"{stage}:r{rank}" or (rank is None and name.startswith(f"{stage}:r")):
            out.append(p.pid)
    return out


def kill_rank(launch_pid: int, stage: str, rank: int) -> int:
    """SIGKILL rank `rank` of `stage` in this launch's process tree; returns its pid."""
    pids = worker_pids(launch_pid, stage, rank=rank)
    assert len(pids) == 1, f"expected one {stage} rank {rank} under launch pid {launch_pid}, found {pids}"
    os.kill(pids[0], signal.SIGKILL)
    return pids[0]


def copy_run(run_dir, runs_root) -> Path:
    """A copy of `run_dir` at ``<runs_root>/<job_name>/<run_id>`` (the job and run id of the original)."""
    src = Path(run_dir)
    dest = Path(runs_root) / src.parent.name / src.name
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(src, dest, symlinks=True)
    for d, dirs, files in os.walk(dest):   # the masters are read-only; a copy is the test's own
        os.chmod(d, 0o755)
        for f in files:
            if not os.path.islink(os.path.join(d, f)):
                os.chmod(os.path.join(d, f), 0o644)
    return dest


def _read_only(tree: Path) -> None:
    for d, dirs, files in os.walk(tree):
        for f in files:
            if not os.path.islink(os.path.join(d, f)):
                os.chmod(os.path.join(d, f), 0o444)
    for d, dirs, files in os.walk(tree, topdown=False):
        os.chmod(d, 0o555)


@dataclass(frozen=True)
class KillResumeRun:
    killed: Path          # the run directory after the killed launch (read-only)
    killed_code: int
    killed_out: str
    killed_pid: int       # the pid of quantize rank 1, SIGKILLed
    completed: Path       # the same run after `--resume` (read-only)
    resume_code: int
    resume_out: str

    def copy_killed(self, runs_root) -> Path:
        return copy_run(self.killed, runs_root)

    def copy_completed(self, runs_root) -> Path:
        return copy_run(self.completed, runs_root)


def make_kill_resume_run(base: Path) -> KillResumeRun:
    runs = base / "runs"
    # 1. kill rank 1 during quantize, once calibration has started
    proc = launch(f"runs_root={runs}", env=OWN_ZYGOTE)
    run_dir, lines, killed_pid = None, [], None
    deadline = time.time() + 600
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("[launch] run directory: "):
                run_dir = line.split(": ", 1)[1].strip()
            if "calibration batch" in line or "quantized in" in line:
                killed_pid = kill_rank(proc.pid, "quantize", 1)
                break
            assert time.time() < deadline, "quantize never started calibrating"
        else:
            raise AssertionError("launch ended before quantize calibrated:\n" + "".join(lines)[-3000:])
        killed_code, rest = finish(proc)
    except BaseException:
        proc.kill()
        raise
    assert run_dir, "".join(lines)
    killed = base / "killed" / "runs"
    killed_copy = copy_run(run_dir, killed)   # the state the kill left, before the resume changes it
    # 2. resume: everything runs and passes (export profiled: PTQ_PROFILE, launcher/profiling.py)
    resume_code, resume_out = finish(launch(f"runs_root={runs}", "--resume", run_dir,
                                            env={"PTQ_PROFILE": "export", **OWN_ZYGOTE}))
    _read_only(killed_copy)
    _read_only(Path(run_dir))
    return KillResumeRun(killed=killed_copy, killed_code=killed_code, killed_out="".join(lines) + rest,
                         killed_pid=killed_pid, completed=Path(run_dir), resume_code=resume_code,
                         resume_out=resume_out)


@pytest.fixture(scope="session")
def tiny_run(tiny_dir, tmp_path_factory) -> KillResumeRun:
    """The session's tiny run, killed then resumed (see the module's docstring); read-only: use
    ``copy_killed`` / ``copy_completed``."""
    return make_kill_resume_run(tmp_path_factory.mktemp("shared_tiny_run"))
