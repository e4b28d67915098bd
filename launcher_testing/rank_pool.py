"""A pool of gloo rank processes that import torch, Megatron-Core and ModelOpt once, then run jobs.

A fresh rank spends 20-40 s importing torch, Megatron-Core and ModelOpt before its first line of
work (measured on the 2-core CI machine: 23 s for one rank, 41 s for four), and a test session
makes about fifteen ``run_on_ranks`` calls.  ``RankPool`` starts ``size`` worker processes once; a
job ("module:function" with JSON kwargs, as for run_on_ranks) then runs on workers 0..nprocs-1
with the rank environment a fresh process would get (RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, MASTER_ADDR, a new MASTER_PORT, and the job's ``env``: set, or removed where
None).  ``launcher_testing.ranks.run_on_ranks`` runs its calls on one such pool per session
(``POOL_SIZE`` = 4 workers) when ``PTQ_RANK_POOL=1``, which tests/conftest.py sets for pytest.

Each job starts from the state a fresh rank has after those imports:
- no process group and no Megatron parallel state (``launcher.megatron.dist.shutdown`` after the
  job, and torch.distributed's default group destroyed if the job left one);
- no process-wide patch (``launcher.megatron.patches.undo_all``): a job gets only the patches it
  applies itself, as in a fresh process, and ``patches.applied_in_process()`` lists only those;
- torch.compile's caches reset (``torch._dynamo.reset``), the thread count, the working
  directory, ``os.environ``, SIGTERM/SIGINT handlers and torch's RNG state put back.
What a fresh process would have that a worker cannot give back is a module imported for the first
time under a job's conditions, and a variable read when the interpreter starts or a library is
imported (CUDA_VISIBLE_DEVICES, PYTHONPATH, OMP_NUM_THREADS, ...).  For the first, a test module
whose ranks need it sets ``FRESH_RANKS = True`` (tests/test_nemotron_h_model.py and
tests/test_gpu_nemotron_h.py: the Mamba stub must precede ``megatron.core.ssm.mamba_mixer``, which
an earlier job's ModelOpt importer may have imported without it); for the second, run_on_ranks
compares the job's environment with the pool's (``launcher.executors.rank_start.IMPORT_TIME_PREFIXES``).  In both cases
run_on_ranks starts fresh processes.

A job that fails ends its worker with the job's exit code, exactly as a fresh rank would
(``sys.exit(3)`` -> 3, an exception -> 1); the other workers get 20 s to fail on their own, then the
whole pool is killed and the next job starts a new one.  A job past its timeout kills the pool the
same way.  So one failure never leaves a later job a worker in an unknown state.  ``JobFailure``
reports each rank's exit code as a fresh run would: 0 for a rank that returned, -9 for one still
running when killed.

Protocol: the parent writes one JSON line per job to each worker's stdin; a worker writes its job's
output (fds 1 and 2) to ``<workdir>/rank<R>.log`` and its result to ``<workdir>/result<R>.json``
after its clean-up, then waits for the next line.  This module is also the workers' entry point
(``python -m launcher_testing.rank_pool``), under the ``__main__`` guard that dist_checkpointing's
writer processes need.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Callable, Optional

PRELOAD = ("torch", "megatron.core", "modelopt.torch.quantization", "transformers")
FAIL_GRACE_S = 20.0
POLL_S = 0.05


def rank_vars(rank: int, nprocs: int, port: int) -> dict[str, str]:
    """The variables torchrun would set for ``rank`` of ``nprocs`` on this host."""
    return {"RANK": str(rank), "WORLD_SIZE": str(nprocs), "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(nprocs), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


RANK_KEYS = tuple(rank_vars(0, 1, 0))


def failure_message(target: str, where: str, timeout_s: float, codes: list, outputs: list[str],
                    timed_out: bool) -> str:
    """``target`` on ``where`` (e.g. "4 ranks") failed: why, then every rank's exit code and output tail."""
    detail = "\n".join(f"----- rank {r} (exit {c}) -----\n{out}" for r, (c, out) in enumerate(zip(codes, outputs)))
    why = f"timed out after {timeout_s} s" if timed_out else f"exit codes {codes}"
    return f"{target} on {where}: {why}\n{detail}"


@dataclass
class JobFailure(Exception):
    """A pooled job failed: every participating rank's exit code (None: still running, then
    killed) and output tail, as run_on_ranks reports a fresh run's."""

    message: str
    returncodes: list
    outputs: list
    timed_out: bool

    def __str__(self) -> str:
        return self.message


class RankPool:
    """``size`` preloaded rank processes; ``run`` a job on the first ``nprocs`` of them."""

    def __init__(self, size: int, env: dict[str, str], cwd: str, free_port: Callable[[], int],
                 preload: tuple[str, ...] = PRELOAD):
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        self.size, self.env, self.cwd, self.free_port = size, dict(env), cwd, free_port
        self.preload = tuple(preload)
        self.procs: list[subprocess.Popen] = []
        self.root = tempfile.mkdtemp(prefix="rank-pool-")
        self.jobs_run = 0
        self.starts = 0

    # ------------------------------------------------------------ life cycle
    def _start(self) -> None:
        self.starts += 1
        self.procs = []
        for slot in range(self.size):
            log = open(os.path.join(self.root, f"worker{slot}-start{self.starts}.log"), "w")
            self.procs.append(subprocess.Popen(
                [sys.executable, "-m", "launcher_testing.rank_pool", ",".join(self.preload)], env=self.env, cwd=self.cwd,
                stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, text=True,
                start_new_session=True))
            log.close()

    def alive(self) -> bool:
        return bool(self.procs) and all(p.poll() is None for p in self.procs)

    def kill(self) -> None:
        for p in self.procs:
            # the worker's own session: it and its children, also where the worker has already ended
            # (a failed job's os._exit) and left children behind, e.g. dist_checkpointing's writer
            # processes: unreaped, the group outlived its leader and they ran on as orphans
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            p.wait()
            if p.stdin:
                try:
                    p.stdin.close()
                except OSError:
                    pass
        self.procs = []

    def close(self) -> None:
        """End the pool for good: its workers, and its folder of job logs and results."""
        import shutil

        self.kill()
        shutil.rmtree(self.root, ignore_errors=True)

    # ------------------------------------------------------------ a job
    def run(self, target: str, nprocs: int, kwargs: Optional[dict] = None, timeout_s: float = 300,
            env: Optional[dict[str, Optional[str]]] = None, tail_chars: int = 6000) -> list:
        """Run ``target`` on ranks 0..nprocs-1; each rank's return value, or JobFailure.  ``env``:
        variables set for the job (None: removed) over the pool's environment."""
        if not 1 <= nprocs <= self.size:
            raise ValueError(f"nprocs={nprocs} does not fit a pool of {self.size} ranks")
        if not self.alive():
            self.kill()
            self._start()
        workdir = tempfile.mkdtemp(prefix="job-", dir=self.root)
        port = self.free_port()
        for rank in range(nprocs):
            rank_env = {**rank_vars(rank, nprocs, port), **(env or {})}
            line = json.dumps({"target": target, "kwargs": kwargs or {}, "env": rank_env,
                               "workdir": workdir, "rank": rank})
            p = self.procs[rank]
            assert p.stdin is not None
            p.stdin.write(line + "\n")
            p.stdin.flush()
        self.jobs_run += 1
        procs = self.procs[:nprocs]
        results: dict[int, object] = {}
        deadline = time.monotonic() + timeout_s
        grace: Optional[float] = None
        timed_out = False
        while len(results) < nprocs:
            for rank in range(nprocs):
                path = os.path.join(workdir, f"result{rank}.json")
                if rank not in results and os.path.exists(path):
                    with open(path) as f:
                        results[rank] = json.load(f)
            if len(results) == nprocs:
                break
            ended = [rank for rank, p in enumerate(procs) if p.poll() is not None]
            now = time.monotonic()
            if ended and grace is None:
                grace = now + FAIL_GRACE_S      # let the other ranks fail on their own first
            if grace is not None and (now > grace or len(set(ended) | set(results)) == nprocs):
                break
            if now > deadline:
                timed_out = True
                break
            time.sleep(POLL_S)
        if len(results) == nprocs and all(p.poll() is None for p in procs):
            return [results[r] for r in range(nprocs)]
        self.kill()                               # nothing of a failed job survives into the next
        # as a fresh run reports it: a rank that returned exited 0, one still running when killed -9
        codes = [0 if os.path.exists(os.path.join(workdir, f"result{rank}.json")) else p.returncode
                 for rank, p in enumerate(procs)]
        outputs = [self._output(workdir, rank)[-tail_chars:] for rank in range(nprocs)]
        raise JobFailure(failure_message(target, f"{nprocs} pooled ranks", timeout_s, codes, outputs, timed_out),
                         codes, outputs, timed_out)

    def _output(self, workdir: str, rank: int) -> str:
        """The job's output on ``rank``; the worker's own log when the job never started there
        (the worker died while importing)."""
        for path in (os.path.join(workdir, f"rank{rank}.log"),
                     os.path.join(self.root, f"worker{rank}-start{self.starts}.log")):
            try:
                with open(path, errors="replace") as f:
                    return f.read()
            except OSError:
                continue
        return ""


# ---------------------------------------------------------------- the worker side
def _reset_after_job(base_env: dict, threads: int, handlers: dict, rng_state) -> None:
    import gc

    import torch

    mods = sys.modules
    if "launcher.megatron.dist" in mods:
        mods["launcher.megatron.dist"].shutdown()
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    if "launcher.megatron.patches" in mods:
        mods["launcher.megatron.patches"].forget_applied_in_process()   # a stage records this job's only
    if hasattr(torch, "_dynamo"):
        torch._dynamo.reset()
    torch.set_num_threads(threads)
    torch.set_rng_state(rng_state)    # a fresh process's default generator, as before the job
    os.environ.clear()
    os.environ.update(base_env)
    for sig, h in handlers.items():
        signal.signal(sig, h)
    gc.collect()


def _set_environ(changes: dict) -> None:
    for key, value in changes.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def _run_job(job: dict, base_env: dict, threads: int, handlers: dict, rng_state, cwd: str) -> int:
    """Run one job with fds 1 and 2 on its log; 0, or the exit code a fresh rank would have had."""
    import importlib
    import traceback

    log_fd = os.open(os.path.join(job["workdir"], f"rank{job['rank']}.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    _set_environ(job["env"])
    os.chdir(cwd)
    code = 0
    try:
        module_name, _, func_name = job["target"].partition(":")
        func = getattr(importlib.import_module(module_name), func_name)
        result = func(**job["kwargs"])
        _reset_after_job(base_env, threads, handlers, rng_state)
        tmp = os.path.join(job["workdir"], f"result{job['rank']}.json.tmp")
        with open(tmp, "w") as f:
            json.dump(result, f)
        os.replace(tmp, tmp[:-4])
    except SystemExit as e:
        from launcher.executors.rank_start import exit_status

        code = exit_status(e) or 1          # a job that exits 0 without returning is a failure here
    except BaseException:         # noqa: BLE001 - reported as a fresh process would, then the worker ends
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    return code


def _worker(preload: list[str]) -> None:
    import importlib
    import warnings

    warnings.simplefilter("ignore")
    sys.path[:0] = [p for p in (os.getcwd(), os.path.join(os.getcwd(), "tests")) if p not in sys.path]
    for name in ["torch", *preload]:
        importlib.import_module(name)
    import torch

    base_env, threads, cwd = dict(os.environ), torch.get_num_threads(), os.getcwd()
    rng_state = torch.get_rng_state()
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    print(f"[rank-pool] worker {os.getpid()} ready: {', '.join(preload)}", flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        code = _run_job(json.loads(line), base_env, threads, handlers, rng_state, cwd)
        if code:
            os._exit(code)   # as a fresh rank would end; the parent replaces the pool


if __name__ == "__main__":
    _worker([m for m in sys.argv[1].split(",") if m] if len(sys.argv) > 1 else list(PRELOAD))
