"""The multi-node mode of tests/slurm_cluster.py: N slurmd hosts on one machine, one network
namespace each (tests/slurm_netns.py), one controller, munge shared.

Use the module fixture ``slurm_multinode`` (it skips, saying why, where namespaces and veth pairs
cannot be made, or Slurm is not installed)::

    from slurm_multinode_cluster import slurm_multinode  # noqa: F401

    def test_x(slurm_multinode):
        subprocess.run(["launch", CONFIG, *slurm_multinode.launch_overrides(), "executor.nodes=2"],
                       env=slurm_multinode.env)
"""
from __future__ import annotations

import os
import shlex
import signal
import socket
import time
from typing import Optional

import pytest

try:  # tests/ on sys.path (pytest's default import mode, or `python tests/slurm_cluster.py`)
    from slurm_cluster import SKIP_REASON, SlurmCluster, _mem_total_mb, _which, missing_binaries
    from slurm_netns import HUB_ADDR, NetnsCluster, cleanup_stale, unavailable_reason
except ImportError:  # pragma: no cover
    from tests.slurm_cluster import SKIP_REASON, SlurmCluster, _mem_total_mb, _which, missing_binaries
    from tests.slurm_netns import HUB_ADDR, NetnsCluster, cleanup_stale, unavailable_reason


class MultiNodeSlurmCluster(SlurmCluster):
    """``nodes`` slurmd hosts (node01, node02, ...), each in its own network namespace, spool and log;
    one slurmctld in a hub namespace that is also the login node; munged shared (a Unix socket).

    tests/slurm_netns.py builds the namespaces (a bridge in the hub, a veth per node, private
    addresses that exist only inside them).  Slurm itself needs no name resolution (NodeAddr);
    jobs do (MASTER_ADDR is a node name): each namespace's /etc/hosts names every node.  Clients
    (sbatch, scontrol, ...) must run in the hub, the login node: ``env`` puts wrappers that do so
    first on PATH, so `launch` and the executor work unchanged.  SLURM_CONF is *not* exported
    into this process (the single-node cluster may be using it): pass ``env``, or monkeypatch.

    Slurm's failure detection is set low (``TIMEOUTS``) so fault tests take seconds, not minutes.
    """

    # (default in 22.05) SlurmdTimeout 300 s: a silent node is DOWN (its jobs NODE_FAIL) after this,
    # pinged every SlurmdTimeout/3; MessageTimeout 10 s: one RPC round trip; TCPTimeout 2 s: a
    # connect; KillWait 30 s: SIGTERM -> SIGKILL when a job is cancelled or fails.
    TIMEOUTS = {"SlurmdTimeout": 10, "MessageTimeout": 5, "TCPTimeout": 2, "KillWait": 2}

    def __init__(self, nodes: int = 2, cpus: int = 8, root: Optional[str] = None, start_timeout_s: float = 60.0):
        if nodes < 2:
            raise ValueError(f"MultiNodeSlurmCluster needs nodes >= 2, got {nodes} (use SlurmCluster for one)")
        super().__init__(root=root, cpus=cpus, start_timeout_s=start_timeout_s)
        self.nodes = [f"node{i:02d}" for i in range(1, nodes + 1)]
        self.net = NetnsCluster(self.nodes)

    def _host_conf_lines(self) -> list[str]:
        r = self.root
        # slurmctld insists on running on a host named in SlurmctldHost: this machine's name, at the
        # hub's address (the address is what clients use)
        lines = [f"SlurmctldHost={socket.gethostname().split('.')[0]}({HUB_ADDR})", f"SlurmdSpoolDir={r}/d/%n",
                 f"SlurmdPidFile={r}/slurmd-%n.pid", f"SlurmdLogFile={r}/log/slurmd-%n.log"]
        lines += [f"{k}={v}" for k, v in self.TIMEOUTS.items()]
        lines += [f"NodeName={n} NodeAddr={self.net.addr[n]} CPUs={self.cpus} RealMemory={_mem_total_mb()} "
                  "State=UNKNOWN" for n in self.nodes]
        lines.append("PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES")
        return lines

    def start(self) -> "MultiNodeSlurmCluster":
        missing = missing_binaries()
        if missing:
            raise FileNotFoundError(SKIP_REASON.format(missing=", ".join(missing)))
        cleanup_stale()
        for node in self.nodes:
            os.makedirs(os.path.join(self.root, "d", node), exist_ok=True)
        try:
            self.net.create(os.path.join(self.root, "hosts"))
            super().start()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Cancel the jobs, stop the daemons, then kill what is left in the namespaces and delete them."""
        try:
            super().stop()
        finally:
            self.net.destroy()

    def host_prefix(self, node: Optional[str]) -> list[str]:
        return self.net.exec_prefix(node)

    def _slurmd(self, node: str) -> str:
        return f"slurmd-{node}"

    def _publish_env(self) -> None:
        pass   # the single-node cluster may own SLURM_CONF in this process: callers pass self.env

    # ------------------------------------------------------------------ the login node
    CLIENTS = ("sbatch", "srun", "scontrol", "squeue", "scancel", "sinfo")

    def _write_files(self) -> None:
        super()._write_files()
        os.makedirs(self.bin_dir, exist_ok=True)
        clean_path = os.environ.get("PATH", "")
        for tool in self.CLIENTS:
            # the hub is the login node: each client runs there; PATH without this folder, so a job
            # submitted from here does not inherit it (its srun must run on the node, not the hub)
            argv = [*self.net.exec_prefix(None), _which(tool) or tool]
            path = os.path.join(self.bin_dir, tool)
            with open(path, "w") as f:
                f.write(f"#!/bin/sh\nexport PATH={shlex.quote(clean_path)}\nexec {shlex.join(argv)} \"$@\"\n")
            os.chmod(path, 0o755)

    @property
    def bin_dir(self) -> str:
        return os.path.join(self.root, "bin")

    @property
    def env(self) -> dict[str, str]:
        """os.environ plus SLURM_CONF, and PATH starting with the login node's client tools: what
        `launch` (a subprocess, or this process under monkeypatch) needs to reach this cluster."""
        return {**os.environ, "SLURM_CONF": self.conf,
                "PATH": self.bin_dir + os.pathsep + os.environ.get("PATH", "")}

    def wait_node(self, node: str, states: tuple[str, ...], timeout_s: float = 60.0) -> str:
        """Wait until sinfo shows ``node`` in one of ``states`` exactly (``idle``, not ``idle*`` - the
        star means not responding); returns the state."""
        deadline = time.monotonic() + timeout_s
        while True:
            state = self.node_states().get(node, "")
            if state in states:
                return state
            if time.monotonic() > deadline:
                raise TimeoutError(f"{node} is {state!r} after {timeout_s:.0f} s, wanted {states}\n" + self.logs_tail())
            time.sleep(0.5)

    def return_node(self, node: str, timeout_s: float = 60.0) -> None:
        """What an operator does once a node is fixed: ``scontrol update State=RESUME``, then wait
        until it is idle.  (ReturnToService=2 brings it back by itself, but slurmctld asks a node
        that is DOWN and not responding to register only every 20th ping: 51 s measured here.)"""
        if self.node_states().get(node) != "idle":
            self.run("scontrol", "update", f"NodeName={node}", "State=RESUME", check=False)
        self.wait_node(node, ("idle",), timeout_s)

    def stop_slurmd(self, node: str, sig: int = signal.SIGTERM) -> None:
        """Stop ``node``'s slurmd the way `systemctl stop slurmd` does: the daemon only, its job steps
        (slurmstepd and the ranks) keep running until Slurm or their peers end them."""
        p = self.procs[self._slurmd(node)]
        p.send_signal(sig)
        p.wait(timeout=15)

    def start_slurmd(self, node: str, wait: bool = True) -> None:
        """(Re)start ``node``'s slurmd; with ``wait``, until the controller has it idle again."""
        self._spawn(self._slurmd(node), [*self.host_prefix(node), _which("slurmd"), "-D", "-N", node, "-f", self.conf])
        if wait:
            self.wait_node(node, ("idle", "mixed"))   # its registration returns it (ReturnToService=2)

    def set_link(self, node: str, up: bool) -> None:
        """``node``'s only network link down (unreachable: controller and peers alike) or up again."""
        self.net.set_link(node, up)

    def node_pids(self, node: str) -> list[int]:
        """Every process running on ``node`` (in its namespace): slurmd, slurmstepd, the ranks."""
        return self.net.pids(node)


@pytest.fixture(scope="module")
def slurm_multinode():
    """A running two-node cluster (network namespaces) for one test module; skips where it cannot run."""
    missing = missing_binaries()
    if missing:
        pytest.skip(SKIP_REASON.format(missing=", ".join(missing)))
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"multi-node Slurm tests skipped: {reason}")
    cluster = MultiNodeSlurmCluster()
    try:
        cluster.start()
    except Exception:
        cluster.cleanup()
        raise
    try:
        yield cluster
    finally:
        cluster.cleanup()

