"""Network namespaces that turn one machine into several Slurm hosts (tests only, root only).

Layout of one cluster (``tag`` = ``slurmci<pid>c<n>``, unique per creating process)::

    <tag>-hub        bridge br0 10.213.0.1/24: the controller (slurmctld) and the login node
    <tag>-node01     eth0 10.213.0.11/24  --veth--  v-node01 (port of br0 in the hub)
    <tag>-node02     eth0 10.213.0.12/24  --veth--  v-node02
    ...

Every link and address exists only inside namespaces created here; nothing in the machine's own
network namespace is touched, and nothing outside is reachable from the nodes (no default
route).  munged needs no network (a Unix socket on the shared file system), so it runs outside.

``exec_prefix(node)`` runs a command on a node: ``nsenter --net`` into its namespace, plus a private
mount namespace whose /etc/hosts is the cluster's hosts file (the machine's own lines - so its
hostname still resolves to loopback, as on a stock Debian/Ubuntu host, the snag gloo trips over -
then one line per node).  Not ``ip netns exec``: that remounts /sys, which hides the cgroup
mounts slurmd 22.05 insists on finding, and it needs files under /etc/netns.

``destroy`` kills what is still running inside the namespaces (processes the cluster started)
and deletes them; ``cleanup_stale`` does the same at start for clusters whose creating process
is gone (a test killed with SIGKILL), so a run never inherits a leftover.
"""
from __future__ import annotations

import itertools
import os
import re
import shutil
import signal
import subprocess
import time
from typing import Optional

PREFIX = "slurmci"
SUBNET = "10.213.0"          # a private /24 that exists only inside the namespaces
HUB_ADDR = f"{SUBNET}.1"
NETNS_RUN = "/run/netns"
# bind the hosts file over /etc/hosts in a private mount namespace, then exec the command
_WITH_HOSTS = 'mount --bind "$0" /etc/hosts && exec "$@"'
_TAG = re.compile(rf"^{PREFIX}(\d+)c\d+-")
_COUNTER = itertools.count()


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and r.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed (exit {r.returncode}): {r.stderr.strip()}")
    return r


def list_namespaces() -> list[str]:
    r = _ip("netns", "list", check=False)
    return [line.split()[0] for line in r.stdout.splitlines() if line.strip()]


def namespace_pids(ns: str) -> list[int]:
    r = _ip("netns", "pids", ns, check=False)
    return [int(p) for p in r.stdout.split() if p.isdigit()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_and_delete(ns: str) -> None:
    """SIGKILL what runs inside ``ns`` (only processes a test cluster started there), then delete it."""
    for _ in range(20):
        pids = [p for p in namespace_pids(ns) if p != os.getpid()]
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)
    _ip("netns", "del", ns, check=False)


def cleanup_stale() -> list[str]:
    """Delete test namespaces whose creating process is dead (and what runs in them); returns them."""
    stale = []
    for ns in list_namespaces():
        m = _TAG.match(ns)
        if m and not _pid_alive(int(m.group(1))):
            _kill_and_delete(ns)
            stale.append(ns)
    return stale


def unavailable_reason() -> Optional[str]:
    """None when this process can create namespaces and veth pairs; else why not (for a skip)."""
    if os.geteuid() != 0:
        return "network namespaces need root (run the multi-node Slurm tests as root, e.g. in the CI container)"
    for tool, pkg in (("ip", "iproute2"), ("nsenter", "util-linux"), ("unshare", "util-linux")):
        if shutil.which(tool) is None:
            return f"`{tool}` not found: apt-get install {pkg}"
    probe = NetnsCluster(["probe"])
    try:
        probe.create()
    except (RuntimeError, OSError, subprocess.SubprocessError) as e:
        return f"cannot create network namespaces / veth pairs here: {e}"
    finally:
        probe.destroy()
    return None


class NetnsCluster:
    """A hub namespace with a bridge and one namespace per node, each on a veth into the bridge."""

    def __init__(self, nodes: list[str]):
        if len(nodes) > 200:
            raise ValueError(f"at most 200 nodes on {SUBNET}.0/24, got {len(nodes)}")
        self.tag = f"{PREFIX}{os.getpid()}c{next(_COUNTER)}"
        self.nodes = list(nodes)
        self.hub = f"{self.tag}-hub"
        self.ns = {n: f"{self.tag}-{n}" for n in self.nodes}
        self.addr = {n: f"{SUBNET}.{11 + i}" for i, n in enumerate(self.nodes)}
        self._created: list[str] = []
        self.hosts_path = ""

    def hosts_text(self) -> str:
        """/etc/hosts of every namespace: the machine's own lines, then one per node."""
        try:
            with open("/etc/hosts") as f:
                own = [line.rstrip("\n") for line in f if line.strip() and not line.lstrip().startswith("#")]
        except OSError:
            own = ["127.0.0.1 localhost"]
        lines = own + [f"{self.addr[n]} {n}" for n in self.nodes]
        return "\n".join(lines) + "\n"

    def create(self, hosts_path: Optional[str] = None) -> "NetnsCluster":
        """Namespaces, bridge, veths and addresses; the hosts file written at ``hosts_path`` (needed
        by ``exec_prefix``; a probe that runs nothing inside passes None)."""
        if hosts_path:
            self.hosts_path = hosts_path
            with open(hosts_path, "w") as f:
                f.write(self.hosts_text())
        for ns in [self.hub, *self.ns.values()]:
            _ip("netns", "add", ns)
            self._created.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.hub, "addr", "add", f"{HUB_ADDR}/24", "dev", "br0")
        _ip("-n", self.hub, "link", "set", "br0", "up")
        for node in self.nodes:
            port = self.port(node)
            _ip("-n", self.hub, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", self.ns[node])
            _ip("-n", self.hub, "link", "set", port, "master", "br0")
            _ip("-n", self.hub, "link", "set", port, "up")
            _ip("-n", self.ns[node], "addr", "add", f"{self.addr[node]}/24", "dev", "eth0")
            _ip("-n", self.ns[node], "link", "set", "eth0", "up")
        return self

    @staticmethod
    def port(node: str) -> str:
        return f"v-{node}"[:15]          # the hub-side end of the node's veth (IFNAMSIZ 16)

    def exec_prefix(self, node: Optional[str] = None) -> list[str]:
        """argv prefix that runs a command on ``node`` (None: the hub, i.e. controller/login).
        No fork anywhere: the command keeps the PID that Popen returns."""
        assert self.hosts_path, "create(hosts_path) first"
        ns = self.hub if node is None else self.ns[node]
        return ["nsenter", f"--net={NETNS_RUN}/{ns}", "unshare", "--mount", "--propagation", "private",
                "sh", "-c", _WITH_HOSTS, self.hosts_path]

    def set_link(self, node: str, up: bool) -> None:
        """Take ``node``'s only link down (unreachable from everything) or bring it back."""
        _ip("-n", self.ns[node], "link", "set", "eth0", "up" if up else "down")

    def pids(self, node: str) -> list[int]:
        return namespace_pids(self.ns[node])

    def destroy(self) -> None:
        for ns in reversed(self._created):
            _kill_and_delete(ns)
        self._created.clear()
