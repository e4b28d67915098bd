"""Local executor: every stage as N processes on this machine.

`launch` (no torch) starts ``launcher.executors.local_agent`` (torch.distributed's elastic
agent used as a library) in its own process group, tees its output to the stage's log.txt
and to the console, and maps its exit code to a state.  Ctrl-C / SIGTERM stop the whole group.
Where the ranks are forked (``executor.rank_start=auto`` on CPU: launcher.executors.rank_start),
the agents themselves are forked from one preloaded process per run
(``launcher.executors.local_zygote``), so the stack is imported once per run, not once per stage;
where ``PTQ_LOCAL_ZYGOTE`` names a shared preloaded process (``local_zygote --listen PATH``), from that
one, so it is imported once for many runs (the test session's launches).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Iterator

from launcher.contract import Device, ExitCode, RankStart, StageStatus
from launcher.executors import rank_start
from launcher.executors.base import CANCELLED, COMPLETED, FAILED, Progress, StagePlan, StageResult
from launcher.executors.local_zygote import SHARED_ENV, Zygote, ZygoteGone
from launcher.ports import free_port


class LocalExecutor:
    """The ``Executor`` protocol on this machine: one stage at a time, each as N processes."""

    chains_failures = False
    detached = False

    def __init__(self, cfg, run_dir: str, echo: bool = True):
        self.cfg = cfg
        self.run_dir = run_dir
        self.echo = echo
        self._proc = None   # the running stage's agent: a subprocess.Popen, or a ForkedAgent
        self._zygote: Zygote | None = None
        self._zygote_tried = False

    def run(self, plans: list[StagePlan], progress: Progress, preflight_only: bool = False,
            detach: bool = False) -> Iterator[StageResult]:
        what = "preflight" if preflight_only else "running"
        try:
            for plan in plans:
                progress(plan.name, f"{what} on {plan.world_size} local rank(s) -> {plan.log_path}",
                         status=StageStatus.RUNNING, world_size=plan.world_size)
                yield self.run_stage(plan)
        finally:
            self.close()

    def close(self) -> None:
        """End the run's preloaded process, if one was started."""
        zygote, self._zygote = self._zygote, None
        if zygote is not None:
            zygote.close()

    def describe(self, plan: StagePlan) -> list[str]:
        return self.agent_argv(plan, self.cfg.master_port or 0)

    def rank_start(self) -> str:
        return str(getattr(self.cfg, "rank_start", None) or RankStart.auto)

    def agent_argv(self, plan: StagePlan, port: int) -> list[str]:
        return [sys.executable, "-m", "launcher.executors.local_agent", str(plan.world_size), str(port),
                "--start", self.rank_start(), "--", *plan.argv]

    def environment(self, plan: StagePlan) -> dict[str, str]:
        env = dict(os.environ)
        env.update(plan.env)
        env["PYTHONUNBUFFERED"] = "1"
        env.setdefault("OMP_NUM_THREADS", str(self.cfg.omp_num_threads))
        if getattr(self.cfg, "device", None) == Device.cpu:   # CPU ranks do not see the GPUs (megatron.patches)
            env["CUDA_VISIBLE_DEVICES"] = ""
        return env

    def may_fork_agents(self, plan: StagePlan, env: dict) -> bool:
        """Whether a preloaded process could fork this run's agents (it decides with torch in hand;
        where the ranks may see a GPU it is not started at all)."""
        if self.rank_start() != RankStart.auto:
            return False
        if getattr(self.cfg, "device", None) == Device.cuda or rank_start.gpu_may_be_visible(env):
            return False
        return rank_start.forkable(plan.argv) is not None

    def start_agent(self, plan: StagePlan, argv: list[str], log):
        """The stage's agent (``argv``: ``agent_argv``): forked from the run's preloaded process where it
        can be, else spawned."""
        env = self.environment(plan)
        if not self._zygote_tried and self.may_fork_agents(plan, env):
            self._zygote_tried = True
            shared = os.environ.get(SHARED_ENV, "")
            if shared not in ("", "0"):
                self._zygote, why = Zygote.connect(shared, plan.argv, env)
                if self._zygote is None:
                    log.write(f"# the shared preloaded process not used: {why}\n")
            if self._zygote is None:
                log.flush()
                self._zygote, why = Zygote.start(plan.argv, env, log.fileno())
            if self._zygote is None:
                log.write(f"# agents spawned: {why}\n")
        if self._zygote is not None and env == self._zygote.env:
            try:
                return self._zygote.fork_agent(argv[3:], env, os.getcwd())
            except ZygoteGone as e:
                log.write(f"# {e}: agents spawned from now on\n")
                self.close()
        return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                bufsize=1, start_new_session=True)

    def run_stage(self, plan: StagePlan) -> StageResult:
        port = self.cfg.master_port or free_port()
        os.makedirs(os.path.dirname(plan.log_path), exist_ok=True)
        start = time.time()
        with open(plan.log_path, "a", buffering=1) as log:
            argv = self.agent_argv(plan, port)
            log.write(f"# {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(argv)}\n")
            self._proc = self.start_agent(plan, argv, log)
            try:
                assert self._proc.stdout is not None
                for line in self._proc.stdout:
                    log.write(line)
                    if self.echo:
                        sys.stdout.write(line)
                        sys.stdout.flush()
                code = self._proc.wait()
            except KeyboardInterrupt:
                self.cancel()
                log.write("# cancelled (Ctrl-C)\n")
                return StageResult(plan.name, CANCELLED, ExitCode.CANCELLED, time.time() - start, interrupted=True)
            except BaseException:     # the launcher's side failed (its log on a full disk): stop the stage too
                self.cancel()
                raise
            finally:
                if self._proc.stdout is not None:
                    self._proc.stdout.close()
                self._proc = None
        return StageResult(plan.name, COMPLETED if code == 0 else FAILED, code, time.time() - start)

    def cancel(self) -> None:
        """Stop the running stage's process group (SIGTERM, then SIGKILL)."""
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                proc.wait(timeout=wait)
                return
            except subprocess.TimeoutExpired:
                continue
