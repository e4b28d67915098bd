"""`python -m launcher.executors.local_agent NPROC PORT [--start auto|spawn] -- CMD...`: one local stage's ranks.

Runs torch.distributed.run's elastic agent as a library (``elastic_launch``): it starts NPROC
workers with RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT set, watches them, and
when one rank dies (an exception, SIGKILL, a failed gate) tears the others down.  This process
exits with the failing rank's exit code (0 when every rank succeeded), so the stage's meaning
(gate failed = 3, desync = 4, ...) reaches the pipeline.

``--start auto`` (``executor.rank_start``) forks the ranks from this process after it imported
torch, Megatron-Core and ModelOpt once, where that is safe (``launcher.executors.rank_start``
says when); otherwise, and with ``--start spawn``, each rank is a new interpreter running CMD.

Its own process is separate from `launch` so the console/log tee and Ctrl-C handling stay in
the launcher, which imports no torch.
"""
from __future__ import annotations

import os
import sys
from typing import Optional

USAGE = "usage: python -m launcher.executors.local_agent NPROC PORT [--start auto|spawn] -- CMD [ARGS...]"


def parse(argv: list[str]) -> tuple[int, int, str, list[str]]:
    """(nproc, port, start, cmd); ValueError with the usage for anything else."""
    if "--" not in argv:
        raise ValueError(USAGE)
    head, cmd = argv[:argv.index("--")], argv[argv.index("--") + 1:]
    start = "spawn"
    if len(head) == 4 and head[2] == "--start":
        start = head[3]
        head = head[:2]
    if len(head) != 2 or not cmd or start not in ("auto", "spawn") or not all(h.isdigit() for h in head):
        raise ValueError(USAGE)
    return int(head[0]), int(head[1]), start, cmd


def main(argv: list[str], preload_s: Optional[float] = None, shared: Optional[str] = None) -> int:
    """``preload_s``: this agent was forked from the run's preloaded process
    (``launcher.executors.local_zygote``), whose import of the stack took that long; ``shared``: the
    socket of the shared preloaded process that forked it (``PTQ_LOCAL_ZYGOTE``), if it was that one."""
    try:
        nproc, port, start, cmd = parse(argv)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    import torch
    from launcher.executors import rank_start

    method, why = rank_start.choose(start, cmd, os.environ, torch.version.cuda)
    entrypoint, args = cmd[0], cmd[1:]
    if method == rank_start.FORK:
        took = rank_start.preload()   # nothing left to import where the run's preloaded process forked this agent
        if preload_s is None:
            when = f"{took:.1f}s"
        else:
            when = f"{preload_s:.1f}s, " + (f"once for every run served by {shared}" if shared else "once for the run")
        print(f"[local-agent] {nproc} rank(s) forked after one import of {', '.join(rank_start.PRELOAD)} "
              f"({when}; {why})", flush=True)
        entrypoint, args = rank_start.run_forked_rank, rank_start.forkable(cmd)
        rank_start.quiet_failed_rank_tracebacks()
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc,
        rdzv_backend="static", rdzv_endpoint=f"127.0.0.1:{port}", rdzv_configs={"rank": 0, "timeout": 120},
        max_restarts=0, monitor_interval=0.2, start_method=method, run_id=f"stage-{port}",
    )
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        elastic_launch(config, entrypoint=entrypoint)(*args)
    except ChildFailedError as e:
        failures = sorted(e.failures.items())
        for rank, failure in failures:
            print(f"[local-agent] rank {rank} exited with {failure.exitcode}", file=sys.stderr, flush=True)
        first = min(failures, key=lambda kv: kv[1].timestamp)[1]
        code = first.exitcode
        return code if code and code > 0 else 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
