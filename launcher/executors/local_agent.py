"""`python -m launcher.executors.local_agent NPROC PORT -- CMD...`: one local stage's ranks.

Runs torch.distributed.run's elastic agent as a library (``elastic_launch``): it starts NPROC
worker processes with RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT set, watches
them, and when one rank dies (an exception, SIGKILL, a failed gate) tears the others down.
This process exits with the failing rank's exit code (0 when every rank succeeded), so the
stage's meaning (gate failed = 3, desync = 4, ...) reaches the pipeline.

Its own process is separate from `launch` so the console/log tee and Ctrl-C handling stay in
the launcher, which imports no torch.
"""
from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    if len(argv) < 4 or argv[2] != "--":
        print("usage: python -m launcher.executors.local_agent NPROC PORT -- CMD [ARGS...]", file=sys.stderr)
        return 2
    nproc, port, cmd = int(argv[0]), int(argv[1]), argv[3:]
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc,
        rdzv_backend="static", rdzv_endpoint=f"127.0.0.1:{port}", rdzv_configs={"rank": 0, "timeout": 120},
        max_restarts=0, monitor_interval=0.2, start_method="spawn", run_id=f"stage-{port}",
    )
    try:
        elastic_launch(config, entrypoint=cmd[0])(*cmd[1:])
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
