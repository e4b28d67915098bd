"""Real Slurm clusters for tests: munge + slurmctld + slurmd, one node on loopback or several nodes.

Use the session fixture ``slurm_cluster`` (import it into a test module or a conftest; several
importers share one cluster)::

    from slurm_cluster import slurm_cluster  # noqa: F401  (tests/ is on sys.path under pytest)

    def test_x(slurm_cluster, tmp_path):
        states = slurm_cluster.run_plans(plans, str(tmp_path))   # submit + follow, returns states

Multi-node mode (tests/slurm_multinode_cluster.py): the module fixture ``slurm_multinode``
(``MultiNodeSlurmCluster``, 2 nodes), each slurmd in its own network namespace, spool and log, the
controller in a hub namespace that is also the login node (tests/slurm_netns.py); it skips,
saying why, where namespaces cannot be made.

Everything lives under a private temporary directory (config, munge key and socket, state, spool,
logs); ports are free ports of 127.0.0.1; ``FirstJobId`` is derived from the clock so job ids
never repeat across runs (a wiped state restarts ids at 1).  The daemons run
in the foreground as children of the test process (``-D``/``-F``), so stopping them is a plain
terminate + wait; every job of the cluster is cancelled first so no ``slurmstepd`` lingers.
``SLURM_CONF`` is exported for the whole session (clients look the controller up in DNS without
it) and restored afterwards.  When the binaries are absent the fixture skips with the install
command (``scripts/install_slurm.sh``).

Run ``python tests/slurm_cluster.py [--nodes 2]`` to start a cluster by hand (Ctrl-C stops it).
"""
from __future__ import annotations

import atexit
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Optional

import pytest

from launcher.ports import free_port

BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "squeue", "scancel", "sinfo")
SKIP_REASON = ("Slurm binaries not found ({missing}); install them with `sudo scripts/install_slurm.sh` "
               "(apt: slurmctld slurmd slurm-client munge)")
SBIN_DIRS = ("/usr/sbin", "/usr/local/sbin", "/sbin")


def _which(name: str) -> Optional[str]:
    found = shutil.which(name)
    if found:
        return found
    for d in SBIN_DIRS:  # daemons live in sbin, which a non-root PATH may lack
        p = os.path.join(d, name)
        if os.access(p, os.X_OK):
            return p
    return None


def missing_binaries() -> list[str]:
    return [b for b in BINARIES if _which(b) is None]


def _die_with_parent() -> None:
    """preexec_fn: the daemon gets SIGTERM when the test process dies, even by SIGKILL (Linux)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _mem_total_mb() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) // 1024
    except OSError:
        pass
    return 4096


def _sigterm_to_exit(signum, frame):  # pragma: no cover - exercised by hand
    raise SystemExit(128 + signum)


class SlurmCluster:
    """One slurmctld + one slurmd ("localhost", 16 advertised CPUs) + munged, under ``root``."""

    def __init__(self, root: Optional[str] = None, cpus: int = 16, start_timeout_s: float = 60.0):
        self._own_root = root is None
        self.root = root or tempfile.mkdtemp(prefix="slurm-ci-")
        self.cpus = cpus
        self.start_timeout_s = start_timeout_s
        self.conf = os.path.join(self.root, "slurm.conf")
        self.nodes = ["localhost"]
        self.procs: dict[str, subprocess.Popen] = {}
        self.first_job_id = 1000 + int(time.time()) % 50_000_000
        self._saved_env: Optional[str] = None
        self._published = False
        self._old_sigterm: Any = None
        self._stopped = False
        self.started = False

    # ------------------------------------------------------------------ environment
    @property
    def env(self) -> dict[str, str]:
        """os.environ plus SLURM_CONF: what a client process needs."""
        return {**os.environ, "SLURM_CONF": self.conf}

    def run(self, *argv: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
        return subprocess.run(list(argv), env=self.env, capture_output=True, text=True, check=check,
                              timeout=timeout)

    # ------------------------------------------------------------------ lifecycle
    def _write_files(self) -> None:
        r = self.root
        for sub in ("munge", "ctld", "d", "log"):
            os.makedirs(os.path.join(r, sub), exist_ok=True)
        # munged refuses a socket directory (or its parent) that is not 755
        for d in (r, os.path.join(r, "munge")):
            os.chmod(d, 0o755)
        key = os.path.join(r, "munge", "munge.key")
        if not os.path.exists(key):
            with open(key, "wb") as f:
                f.write(os.urandom(1024))
            os.chmod(key, 0o400)
        ctld_port, d_port = free_port(), free_port()
        while d_port == ctld_port:
            d_port = free_port()
        lines = self._common_conf_lines(ctld_port, d_port) + self._host_conf_lines()
        with open(self.conf, "w") as f:
            f.write("\n".join(lines) + "\n")

    def _common_conf_lines(self, ctld_port: int, d_port: int) -> list[str]:
        r = self.root
        user = "root" if os.geteuid() == 0 else os.environ.get("USER", "root")
        return [
            "ClusterName=localci",
            f"SlurmUser={user}",
            f"SlurmdUser={user}",
            f"SlurmctldPort={ctld_port}",
            f"SlurmdPort={d_port}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={r}/munge/munge.socket.2",
            f"StateSaveLocation={r}/ctld",
            f"SlurmctldPidFile={r}/slurmctld.pid",
            f"SlurmctldLogFile={r}/log/slurmctld.log",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/filetxt",
            f"JobCompLoc={r}/jobcomp.txt",
            "SchedulerType=sched/backfill",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "MpiDefault=none",
            "MailProg=/bin/true",
            "ReturnToService=2",
            "SlurmdParameters=config_overrides",
            "MinJobAge=3600",
            "InactiveLimit=0",
            "Waittime=0",
            f"FirstJobId={self.first_job_id}",
        ]

    def _host_conf_lines(self) -> list[str]:
        """Where the controller and the node live: everything on loopback, one node."""
        r = self.root
        return [
            "SlurmctldHost=localhost(127.0.0.1)",
            f"SlurmdSpoolDir={r}/d",
            f"SlurmdPidFile={r}/slurmd.pid",
            f"SlurmdLogFile={r}/log/slurmd.log",
            "KillWait=5",
            f"NodeName=localhost NodeAddr=127.0.0.1 CPUs={self.cpus} RealMemory={_mem_total_mb()} State=UNKNOWN",
            "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES",
        ]

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = open(os.path.join(self.root, "log", f"{name}.out"), "ab")
        # own session: a Ctrl-C in the terminal reaches the test process, whose cleanup cancels the
        # jobs before stopping the daemons; PDEATHSIG covers a test process that is killed outright
        daemon_env = {**os.environ, "SLURM_CONF": self.conf}   # no client wrappers (multi-node) in daemons
        self.procs[name] = subprocess.Popen(argv, env=daemon_env, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True,
                                            preexec_fn=_die_with_parent)
        log.close()

    def _check_alive(self) -> None:
        for name, p in self.procs.items():
            if p.poll() is not None:
                raise RuntimeError(f"{name} exited with {p.returncode} while starting; see "
                                   f"{self.root}/log/{name}.out and {self.root}/log/*.log\n" + self.logs_tail())

    def _wait(self, what: str, ok: Callable[[], bool]) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while not ok():
            self._check_alive()
            if time.monotonic() > deadline:
                raise RuntimeError(f"Slurm test cluster: timed out waiting for {what}\n" + self.logs_tail())
            time.sleep(0.2)

    def start(self) -> "SlurmCluster":
        missing = missing_binaries()
        if missing:
            raise FileNotFoundError(SKIP_REASON.format(missing=", ".join(missing)))
        self._write_files()
        atexit.register(self.cleanup)
        if (threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL):
            # SIGTERM (CI cancelling the step, `timeout`) -> SystemExit, so cleanup still runs
            self._old_sigterm = signal.signal(signal.SIGTERM, _sigterm_to_exit)
        r = self.root
        sock = os.path.join(r, "munge", "munge.socket.2")
        self._spawn("munged", [_which("munged"), "-F", "--force", "--key-file", f"{r}/munge/munge.key",
                               "-S", sock, "--pid-file", f"{r}/munge/munged.pid",
                               "--log-file", f"{r}/log/munged.log", "--seed-file", f"{r}/munge/seed"])
        self._wait("munged socket", lambda: os.path.exists(sock))
        self._spawn("slurmctld", [*self.host_prefix(None), _which("slurmctld"), "-D", "-i", "-f", self.conf])
        self._wait("slurmctld", lambda: self.run("scontrol", "ping", check=False).returncode == 0
                   and "UP" in self.run("scontrol", "ping", check=False).stdout)
        for node in self.nodes:
            self._spawn(self._slurmd(node), [*self.host_prefix(node), _which("slurmd"), "-D", "-N", node,
                                             "-f", self.conf])
        self._wait("nodes idle", self._nodes_idle)
        self._publish_env()
        self.started = True
        return self

    def host_prefix(self, node: Optional[str]) -> list[str]:
        """argv prefix that runs a command on ``node`` (None: the controller); none on one host."""
        return []

    def _slurmd(self, node: str) -> str:
        return "slurmd"

    def _publish_env(self) -> None:
        """Export SLURM_CONF for the whole session: in-process clients (the executor) find the cluster."""
        self._saved_env = os.environ.get("SLURM_CONF")
        os.environ["SLURM_CONF"] = self.conf
        self._published = True

    def node_states(self) -> dict[str, str]:
        """{node: state in lower case} from sinfo (idle, mixed, allocated, down*, ...)."""
        out = self.run("sinfo", "-h", "-N", "-o", "%N %T", check=False).stdout
        return dict(line.split()[:2] for line in out.lower().splitlines() if len(line.split()) >= 2)

    def _nodes_idle(self) -> bool:
        states = self.node_states()
        return all(states.get(n, "").startswith(("idle", "mixed")) for n in self.nodes)

    def job_ids(self, states: str = "all") -> list[str]:
        out = self.run("squeue", "-h", "-t", states, "-o", "%i", check=False).stdout.split()
        return out

    def active_jobs(self) -> list[str]:
        """Jobs still pending, running or completing."""
        return self.job_ids("PENDING,RUNNING,CONFIGURING,COMPLETING,SUSPENDED,REQUEUED")

    def stop(self) -> None:
        """Cancel every job of this cluster, then stop slurmd, slurmctld and munged (in that order)."""
        if self._stopped:
            return
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            try:
                if self.active_jobs():
                    self.run("scancel", "--full", "--user", str(os.getuid()), check=False)
                    deadline = time.monotonic() + 20
                    while self.active_jobs() and time.monotonic() < deadline:
                        time.sleep(0.5)
            except Exception:  # a broken controller must not prevent the daemons from stopping
                pass
        for name in [*(self._slurmd(n) for n in self.nodes), "slurmctld", "munged"]:
            p = self.procs.get(name)
            if p is None or p.poll() is not None:
                continue
            p.terminate()
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)
        if self._old_sigterm is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._old_sigterm)
            self._old_sigterm = None
        self._unpublish_env()
        self.started = False
        self._stopped = True

    def _unpublish_env(self) -> None:
        if not self._published:
            return
        self._published = False
        if self._saved_env is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = self._saved_env

    def cleanup(self) -> None:
        """stop(), then remove the private directory (only when this object created it)."""
        self.stop()
        if self._own_root:
            shutil.rmtree(self.root, ignore_errors=True)

    def logs_tail(self, n: int = 30) -> str:
        out = []
        d = [self._slurmd(n) for n in self.nodes]
        for name in ["munged.log", "slurmctld.log", *(f"{x}.log" for x in d), "munged.out", "slurmctld.out",
                     *(f"{x}.out" for x in d)]:
            p = os.path.join(self.root, "log", name)
            if os.path.exists(p):
                with open(p, errors="replace") as f:
                    lines = f.readlines()[-n:]
                out.append(f"--- {p}\n" + "".join(lines))
        return "\n".join(out)

    # ------------------------------------------------------------------ helpers for pipeline tests
    def executor_config(self, **overrides: Any):
        """A SlurmExecutorConfig (as a DictConfig) that runs on this cluster with this interpreter.

        ``python`` is this test process's interpreter and ``PYTHONPATH`` holds the repository, so
        ``python -m launcher.worker`` works inside the jobs; ``master_port=0`` derives a port from
        the job id (stages of concurrent tests never collide); ``poll_interval_s`` is short.
        """
        from omegaconf import OmegaConf

        from launcher.schema import SlurmExecutorConfig

        repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        cfg = OmegaConf.structured(SlurmExecutorConfig)
        cfg.partition = "debug"
        cfg.time = "00:10:00"
        cfg.python = sys.executable
        cfg.env = {"PYTHONPATH": repo}
        cfg.master_port = 0
        cfg.poll_interval_s = 0.5
        for k, v in overrides.items():
            OmegaConf.update(cfg, k, v, merge=False)
        return cfg

    def launch_overrides(self, **extra: Any) -> list[str]:
        """Hydra overrides that point `launch CONFIG ...` at this cluster (same values as
        ``executor_config``), for the end-to-end test through the CLI::

            rc = launcher.cli.main([example, *slurm_cluster.launch_overrides(), f"runs_root={tmp}"])

        SLURM_CONF is already exported by the fixture, so `launch` and its sbatch find the cluster.
        """
        repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        out = ["executor=slurm", "executor.partition=debug", "executor.time=00:10:00",
               f"executor.python={sys.executable}", f"++executor.env.PYTHONPATH={repo}",
               "executor.master_port=0", "executor.poll_interval_s=0.5"]
        out += [f"executor.{k}={v}" for k, v in extra.items()]
        return out

    def run_plans(self, plans: list, run_dir: str, timeout_s: float = 300, echo: Any = None,
                  **cfg_overrides: Any) -> tuple[dict[str, str], list[tuple[str, str, dict]]]:
        """Submit ``plans`` through ``SlurmExecutor`` and follow them to the end.

        Returns (final state per stage, every (stage, state, info) event in order).  Use it for
        the end-to-end pipeline test: plans from the pipeline, ``run_dir`` the run directory.
        """
        from launcher.executors.slurm import SlurmExecutor

        ex = SlurmExecutor(self.executor_config(**cfg_overrides), run_dir, echo=echo)
        events: list[tuple[str, str, dict]] = []
        ids = ex.submit(plans)
        try:
            final = ex.follow(ids, lambda s, st, info: events.append((s, st, dict(info))), timeout_s=timeout_s)
        except BaseException:
            ex.cancel(ids)
            raise
        return final, events


@pytest.fixture(scope="session")
def slurm_cluster():
    """A running single-node cluster for the whole test session (skips if Slurm is not installed)."""
    missing = missing_binaries()
    if missing:
        pytest.skip(SKIP_REASON.format(missing=", ".join(missing)))
    if os.geteuid() != 0 and not os.environ.get("SLURM_TEST_NONROOT"):
        pytest.skip("the test cluster runs slurmd, which must run as root (run the Slurm tests as root, "
                    "e.g. in the CI container or under sudo; SLURM_TEST_NONROOT=1 tries anyway)")
    global _SHARED, _USERS
    # one cluster per process even when several test modules import this fixture (each import is
    # its own FixtureDef to pytest): reference-counted, stopped when the last user is done
    if _SHARED is None:
        cluster = SlurmCluster()
        try:
            cluster.start()
        except Exception:
            cluster.cleanup()
            raise
        _SHARED = cluster
    _USERS += 1
    try:
        yield _SHARED
    finally:
        _USERS -= 1
        if _USERS == 0 and _SHARED is not None:
            _SHARED.cleanup()
            _SHARED = None


_SHARED: Optional[SlurmCluster] = None
_USERS = 0


if __name__ == "__main__":
    n = int(sys.argv[sys.argv.index("--nodes") + 1]) if "--nodes" in sys.argv else 1
    if n == 1:
        c = SlurmCluster()
    else:
        from slurm_multinode_cluster import MultiNodeSlurmCluster

        c = MultiNodeSlurmCluster(nodes=n)
    c.start()
    path = "" if n == 1 else f" PATH={c.bin_dir}:$PATH"
    print(f"cluster up: export SLURM_CONF={c.conf}{path}  (Ctrl-C stops it)", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        c.cleanup()
