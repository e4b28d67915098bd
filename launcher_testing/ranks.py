"""Run a function on N gloo ranks, with a timeout: on the session's rank pool, or as fresh processes.

    results = run_on_ranks("test_megatron_model:logits_worker", nprocs=4,
                           kwargs={"hf_path": str(path)}, timeout_s=240)

Each rank runs with RANK / WORLD_SIZE / LOCAL_RANK / LOCAL_WORLD_SIZE / MASTER_ADDR / MASTER_PORT
set (as torchrun would), OMP_NUM_THREADS=1, the repository root and ``tests/`` first on
``sys.path`` (so a target in a test module imports) and the repository root as its working
directory.  The function is called as ``function(**kwargs)``; what it returns (JSON-able) is
collected per rank.  Any rank failing, or the run exceeding ``timeout_s``, raises ``RanksFailed``
with every rank's exit code (0: it returned; -9: still running, then killed) and output tail.

Where the ranks run:
- ``PTQ_RANK_POOL=1`` (tests/conftest.py sets it for a pytest session unless it is already set;
  ``PTQ_RANK_POOL=0`` turns it off): on one session-wide ``RankPool`` of ``POOL_SIZE`` workers
  (launcher_testing.rank_pool), started on first use and closed at the end of the session (or at
  interpreter exit).  Its workers import torch, Megatron-Core, ModelOpt and transformers once,
  and each job starts from a fresh rank's state; a failed or hung job kills the pool and the next
  call starts a new one.
- Fresh processes, ``python -m launcher_testing.ranks MODULE:FUNCTION KWARGS_JSON RESULT_DIR``
  (which has the ``__main__`` guard dist_checkpointing's writer needs), when ``fresh_reason``
  gives one: the pool is off; the target's module sets ``FRESH_RANKS = True`` (its ranks must
  import a module for the first time under the job's conditions, e.g. the Mamba stub before
  ``megatron.core.ssm.mamba_mixer``); ``nprocs > POOL_SIZE``; or the rank environment differs
  from the one the pool was started with in a variable read at interpreter start or when the
  preloaded libraries are imported (``rank_start.IMPORT_TIME_PREFIXES``: CUDA_VISIBLE_DEVICES, PYTHONPATH,
  OMP_NUM_THREADS, HF_HUB_OFFLINE, TORCHINDUCTOR_*, ...), e.g. ``env={"CUDA_VISIBLE_DEVICES": ""}``
  where the session leaves it unset.  Any other difference (``env=``, or ``os.environ`` changed
  since the pool started) is applied to the pooled job's environment, variables removed included,
  so a job sees the environment a fresh rank would.
``run_on_ranks`` refuses in a torch-free run (``PTQ_TORCH_FREE=1``, make test-fast).
"""
from __future__ import annotations

import atexit
import importlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Optional

from launcher.executors.rank_start import import_time_differences
from launcher.ports import free_port  # noqa: F401 (also what benchmarks/_common re-exports)
from launcher_testing import rank_pool
from launcher_testing.rank_pool import RANK_KEYS, JobFailure, RankPool, failure_message, rank_vars

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
POOL_ENV = "PTQ_RANK_POOL"
POOL_SIZE = 4

_pool: Optional[RankPool] = None
fresh_runs: list[tuple[str, str]] = []    # (target, reason) of each call run on fresh processes


class RanksFailed(AssertionError):
    def __init__(self, message: str, returncodes: list, outputs: list[str], timed_out: bool):
        super().__init__(message)
        self.returncodes = returncodes
        self.outputs = outputs
        self.timed_out = timed_out


def run_on_ranks(target: str, nprocs: int, kwargs: dict | None = None, timeout_s: float = 300,
                 env: dict[str, str] | None = None, tail_chars: int = 6000) -> list:
    """Run ``target`` ("package.module:function") on ``nprocs`` ranks; return each rank's result."""
    if os.environ.get("PTQ_TORCH_FREE") == "1":
        raise AssertionError(f"{target}: starts torch ranks in a torch-free run (make test-fast); mark the test `torch`")
    reason = fresh_reason(target, nprocs, env)
    if reason is None:
        return _run_pooled(target, nprocs, kwargs, timeout_s, env, tail_chars)
    fresh_runs.append((target, reason))
    return _run_fresh(target, nprocs, kwargs, timeout_s, env, tail_chars)


# ---------------------------------------------------------------- which way
def pool_enabled() -> bool:
    value = os.environ.get(POOL_ENV, "0")
    if value not in ("0", "1"):
        raise ValueError(f"{POOL_ENV} must be 0 or 1, got {value!r}")
    return value == "1"


def fresh_reason(target: str, nprocs: int, env: dict[str, str] | None = None) -> Optional[str]:
    """Why this call must start fresh rank processes; None when the session's pool runs it."""
    if not pool_enabled():
        return f"{POOL_ENV} is not 1"
    module = target.partition(":")[0]
    if getattr(sys.modules.get(module), "FRESH_RANKS", False):
        return f"{module} sets FRESH_RANKS = True"
    if nprocs > POOL_SIZE:
        return f"nprocs={nprocs} is more than the pool's {POOL_SIZE} ranks"
    late = import_time_differences(rank_base_env(env), _pool.env if _pool is not None else rank_base_env())
    if late:
        return f"{', '.join(late)} must be set when a rank starts (the pool's workers have other values)"
    return None


def rank_base_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """Every rank's environment but the rank variables: this process's, the fixed settings, ``env``."""
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": os.pathsep.join([REPO_ROOT, os.path.join(REPO_ROOT, "tests"), os.environ.get("PYTHONPATH", "")]),
        "PYTHONWARNINGS": "ignore",
        **(env or {}),
    }


def env_changes(wanted: dict[str, str]) -> dict[str, Optional[str]]:
    """What a pooled job must change in its worker's environment to get ``wanted`` (None: unset);
    against the pool's start environment (the one it would start with, while not started)."""
    start = _pool.env if _pool is not None else rank_base_env()
    changed: dict[str, Optional[str]] = {k: v for k, v in wanted.items() if start.get(k) != v}
    changed.update({k: None for k in start if k not in wanted})
    return {k: v for k, v in changed.items() if k not in RANK_KEYS}    # each rank's own, set per job


# ---------------------------------------------------------------- the session's pool
def session_pool() -> RankPool:
    """The pool of this process (created on first use; its workers start with its first job)."""
    global _pool
    if _pool is None:
        _pool = RankPool(POOL_SIZE, env=rank_base_env(), cwd=REPO_ROOT, free_port=free_port)
    return _pool


def summary() -> list[str]:
    """What ran where in this process: the pool's jobs and starts, each fresh run and its reason."""
    lines = [f"rank pool: {_pool.jobs_run} jobs on {_pool.size} workers, started {_pool.starts} times"] if _pool else []
    return lines + [f"fresh ranks: {target} ({reason})" for target, reason in fresh_runs]


def close_pool() -> None:
    """End the session's pool, if one was made (tests/conftest.py at session end; at exit)."""
    global _pool
    if _pool is not None:
        _pool.close()
        _pool = None


atexit.register(close_pool)


def _run_pooled(target: str, nprocs: int, kwargs: dict | None, timeout_s: float,
                env: dict[str, str] | None, tail_chars: int) -> list:
    pool = session_pool()
    try:
        return pool.run(target, nprocs, kwargs, timeout_s=timeout_s, env=env_changes(rank_base_env(env)),
                        tail_chars=tail_chars)
    except JobFailure as e:     # reported as a fresh run's failure is (one message, pooled or not)
        raise RanksFailed(failure_message(target, f"{nprocs} ranks", timeout_s, e.returncodes, e.outputs, e.timed_out),
                          e.returncodes, e.outputs, e.timed_out) from None


# ---------------------------------------------------------------- fresh processes
def _run_fresh(target: str, nprocs: int, kwargs: dict | None, timeout_s: float,
               env: dict[str, str] | None, tail_chars: int) -> list:
    port = free_port()
    base_env = rank_base_env(env)
    with tempfile.TemporaryDirectory(prefix="ranks-") as workdir:
        procs, logs = [], []
        for rank in range(nprocs):
            log = open(os.path.join(workdir, f"rank{rank}.log"), "w+")
            logs.append(log)
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "launcher_testing.ranks", target, json.dumps(kwargs or {}), workdir],
                env={**base_env, **rank_vars(rank, nprocs, port)}, stdout=log, stderr=subprocess.STDOUT,
                cwd=REPO_ROOT, start_new_session=True))
        timed_out = _wait(procs, timeout_s)
        outputs = []
        for log in logs:
            log.seek(0)
            outputs.append(log.read()[-tail_chars:])
            log.close()
        codes = [p.returncode for p in procs]
        if timed_out or any(c != 0 for c in codes):
            raise RanksFailed(failure_message(target, f"{nprocs} ranks", timeout_s, codes, outputs, timed_out),
                              codes, outputs, timed_out)
        results = []
        for rank in range(nprocs):
            with open(os.path.join(workdir, f"result{rank}.json")) as f:
                results.append(json.load(f))
        return results


def _wait(procs: list[subprocess.Popen], timeout_s: float) -> bool:
    """Wait for the ranks; kill those left after a timeout or a rank's failure.  True on timeout."""
    deadline = time.time() + timeout_s
    timed_out = False
    while any(p.poll() is None for p in procs):
        if time.time() > deadline:
            timed_out = True
            break
        if any(p.returncode not in (None, 0) for p in procs):
            # one rank died: give the others a moment to fail on their own, then stop them
            grace = time.time() + rank_pool.FAIL_GRACE_S
            while time.time() < grace and any(p.poll() is None for p in procs):
                time.sleep(0.2)
            break
        time.sleep(0.2)
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)   # our own child's process group
            p.wait()
    return timed_out


def _main(target: str, kwargs_json: str, workdir: str) -> None:
    module_name, _, func_name = target.partition(":")
    sys.path[:0] = [REPO_ROOT, os.path.join(REPO_ROOT, "tests")]
    func = getattr(importlib.import_module(module_name), func_name)
    result = func(**json.loads(kwargs_json))
    rank = int(os.environ["RANK"])
    with open(os.path.join(workdir, f"result{rank}.json.tmp"), "w") as f:
        json.dump(result, f)
    os.replace(os.path.join(workdir, f"result{rank}.json.tmp"), os.path.join(workdir, f"result{rank}.json"))


if __name__ == "__main__":
    _main(*sys.argv[1:4])
