"""One run's preloaded process: it imports the stack once and forks every local stage's agent.

``launch`` (no torch) runs its stages one after the other, each as a local agent and its ranks
(``launcher.executors.local_agent``).  Where the ranks are forked (``launcher.executors.rank_start``:
CPU), each agent would import torch, Megatron-Core, ModelOpt and transformers again before it
forks (about 5 s per stage here).  Instead the local executor starts this process once per run:

    python -m launcher.executors.local_zygote FD -- CMD...

FD is one end of a ``SOCK_SEQPACKET`` socket pair; CMD is a stage's rank command.  The zygote
imports torch and asks ``rank_start.choose`` whether CMD's ranks may be forked here; if not it says
so and exits (the executor then spawns each stage's agent as a new interpreter).  Otherwise it
imports ``rank_start.PRELOAD``, says so, and serves one request at a time:

    request  {"argv": [agent args], "env": {...}, "cwd": "..."} with one file descriptor attached,
             the pipe the stage's output goes to
    replies  {"pid": P} once the agent is forked (its own session: the executor stops it with
             killpg), then {"exit": CODE} when it ended (a negative code: the signal that ended it)

It exits when the executor closes its end (the run is over, or ``launch`` died).

**A shared preloaded process** serves many runs (a test session's launches, a loop of runs):

    python -m launcher.executors.local_zygote --listen PATH

imports the stack once, then listens on the ``SOCK_SEQPACKET`` socket PATH (created once the imports
are done).  A run whose ``PTQ_LOCAL_ZYGOTE`` names PATH (``0`` or empty: none) connects instead of
starting its own process and sends ``{"cmd": [...], "env": {...}}``; the listener forks a handler for
the connection, which answers as a run's own process would, then serves that run's requests as above.  It refuses a run
whose environment differs from its own in a variable read at start or import
(``rank_start.IMPORT_TIME_PREFIXES``: CUDA_VISIBLE_DEVICES, OMP_NUM_THREADS, PYTHONWARNINGS, ...),
saying which; that run, and a run that cannot connect, starts its own.  The listener exits when the
process that started it ends, or on SIGTERM.
"""
from __future__ import annotations

import json
import os
import socket
import sys

MAX_MESSAGE = 1 << 20


def send(sock: socket.socket, doc: dict, fds: tuple[int, ...] = ()) -> None:
    data = json.dumps(doc).encode()
    assert len(data) < MAX_MESSAGE, len(data)
    if fds:
        socket.send_fds(sock, [data], list(fds))
    else:
        sock.sendall(data)


def receive(sock: socket.socket, max_fds: int = 0) -> tuple[dict | None, list[int]]:
    """One message and its file descriptors; (None, []) when the peer closed its end."""
    if max_fds:
        data, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, max_fds)
    else:
        data, fds = sock.recv(MAX_MESSAGE), []
    return (json.loads(data) if data else None), fds


SHARED_ENV = "PTQ_LOCAL_ZYGOTE"


def _agent(request: dict, out_fd: int, sock: socket.socket, preload_s: float, shared: str | None = None) -> None:
    """The forked agent: its own session, the stage's pipe as stdout and stderr, the stage's env."""
    code = 1
    try:
        sock.close()
        os.setsid()
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out_fd, 1)
        os.dup2(out_fd, 2)
        os.close(null)
        os.close(out_fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        from launcher.executors import local_agent

        code = local_agent.main(list(request["argv"]), preload_s=preload_s, shared=shared)
    except BaseException as e:  # noqa: BLE001 - the agent's own failure is the stage's
        print(f"[local-agent] failed to start: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def serve(sock: socket.socket, preload_s: float, shared: str | None = None) -> int:
    while True:
        request, fds = receive(sock, max_fds=1)
        if request is None:
            return 0
        assert len(fds) == 1, fds
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _agent(request, fds[0], sock, preload_s, shared)
        os.close(fds[0])
        send(sock, {"pid": pid})
        _, status = os.waitpid(pid, 0)
        send(sock, {"exit": os.waitstatus_to_exitcode(status)})


def _handle(conn: socket.socket, path: str, preload_s: float, cuda_build: str | None, start_env: dict) -> int:
    """A forked handler of the shared process: one run's hello, then its requests.  ``start_env``: the
    shared process's environment before it imported the stack (torch adds TORCHINDUCTOR_CACHE_DIR)."""
    from launcher.executors import rank_start

    hello, _ = receive(conn)
    if hello is None:
        return 0
    method, why = rank_start.choose("auto", hello["cmd"], hello["env"], cuda_build)
    differ = rank_start.import_time_differences(hello["env"], start_env)
    if method != rank_start.FORK:
        send(conn, {"fork": False, "why": why})
        return 0
    if differ:
        send(conn, {"fork": False, "why": f"the shared preloaded process {path} started with other values of "
                                          f"{', '.join(differ)}"})
        return 0
    send(conn, {"fork": True, "why": why, "preload_s": round(preload_s, 2)})
    return serve(conn, preload_s, shared=path)


def listen(path: str, poll_s: float = 1.0) -> int:
    """``--listen PATH``: the shared preloaded process (see the module's docstring)."""
    import signal

    start_env = dict(os.environ)
    import torch

    from launcher.executors import rank_start

    took = rank_start.preload()
    starter = os.getppid()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    tmp = f"{path}.{os.getpid()}.tmp"
    server.bind(tmp)
    server.listen(16)
    os.rename(tmp, path)   # the socket appears ready, never half set up
    server.settimeout(poll_s)
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    try:
        while not stopping and os.getppid() == starter:
            try:
                conn, _ = server.accept()
            except (socket.timeout, InterruptedError):
                _reap()
                continue
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    server.close()
                    signal.signal(signal.SIGTERM, signal.SIG_DFL)
                    conn.settimeout(None)
                    code = _handle(conn, path, took, torch.version.cuda, start_env)
                finally:
                    os._exit(code)
            conn.close()
            _reap()
    finally:
        server.close()
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    return 0


def _reap() -> None:
    """Collect the handlers that ended (each serves one run and exits with it)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "--listen":
        return listen(argv[1])
    if len(argv) < 3 or argv[1] != "--" or not argv[0].isdigit():
        print("usage: python -m launcher.executors.local_zygote FD -- CMD...\n"
              "       python -m launcher.executors.local_zygote --listen PATH", file=sys.stderr)
        return 2
    sock = socket.socket(fileno=int(argv[0]))
    import torch

    from launcher.executors import rank_start

    method, why = rank_start.choose("auto", argv[2:], os.environ, torch.version.cuda)
    if method != rank_start.FORK:
        send(sock, {"fork": False, "why": why})
        return 0
    took = rank_start.preload()
    send(sock, {"fork": True, "why": why, "preload_s": round(took, 2)})
    return serve(sock, took)


# ----------------------------------------------------------------------------- the executor's side

class ZygoteGone(RuntimeError):
    """The preloaded process ended (or never answered); the executor spawns agents instead."""


class ForkedAgent:
    """A stage's agent forked by the zygote, with what the local executor uses of a ``Popen``:
    ``pid`` (its own session), ``stdout`` (the stage's output, text), ``poll`` and ``wait``."""

    def __init__(self, zygote: "Zygote", pid: int, stdout):
        self.zygote, self.pid, self.stdout = zygote, pid, stdout
        self.returncode: int | None = None

    def wait(self, timeout: float | None = None) -> int:
        import subprocess

        if self.returncode is None:
            self.zygote.sock.settimeout(timeout)
            try:
                reply, _ = receive(self.zygote.sock)
            except (socket.timeout, BlockingIOError):
                raise subprocess.TimeoutExpired(f"agent {self.pid}", timeout) from None
            finally:
                self.zygote.sock.settimeout(None)
            if reply is None:
                self.zygote.gone = True
                raise ZygoteGone(f"the preloaded process ended while stage agent {self.pid} ran")
            self.returncode = int(reply["exit"])
        return self.returncode

    def poll(self) -> int | None:
        import subprocess

        try:
            return self.wait(timeout=0)
        except subprocess.TimeoutExpired:
            return None


class Zygote:
    """The executor's handle on one run's preloaded process (``python -m launcher.executors.local_zygote``)."""

    def __init__(self, proc, sock: socket.socket, env: dict, preload_s: float):
        # proc: the run's own preloaded process, or None for the shared one
        self.proc, self.sock, self.env, self.preload_s = proc, sock, env, preload_s
        self.gone = False

    @classmethod
    def start(cls, cmd: list[str], env: dict, log_fd: int) -> tuple["Zygote | None", str]:
        """Start it for ranks running ``cmd`` with ``env``: (the zygote, why) where it forks, else
        (None, why not).  Its own output (nothing, unless it fails) goes to ``log_fd``."""
        import subprocess

        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        proc = subprocess.Popen([sys.executable, "-m", "launcher.executors.local_zygote", str(child.fileno()), "--",
                                 *cmd], pass_fds=[child.fileno()], env=env, stdin=subprocess.DEVNULL, stdout=log_fd,
                                stderr=subprocess.STDOUT, start_new_session=True)
        child.close()
        hello, _ = receive(parent)
        if not hello or not hello["fork"]:
            parent.close()
            proc.wait()
            return None, (hello or {}).get("why") or f"the preloaded process exited {proc.returncode} before it answered"
        return cls(proc, parent, dict(env), float(hello["preload_s"])), hello["why"]

    @classmethod
    def connect(cls, path: str, cmd: list[str], env: dict) -> tuple["Zygote | None", str]:
        """Use the shared preloaded process listening on ``path`` (``PTQ_LOCAL_ZYGOTE``) for ranks running
        ``cmd`` with ``env``: (the zygote, why) where it serves this run, else (None, why not)."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            sock.connect(path)
            send(sock, {"cmd": list(cmd), "env": dict(env)})
            hello, _ = receive(sock)
        except OSError as e:
            sock.close()
            return None, f"{SHARED_ENV}={path}: {e}"
        if not hello or not hello["fork"]:
            sock.close()
            return None, (hello or {}).get("why") or f"the shared preloaded process {path} ended before it answered"
        return cls(None, sock, dict(env), float(hello["preload_s"])), f"{hello['why']}; shared: {path}"

    def fork_agent(self, argv: list[str], env: dict, cwd: str) -> ForkedAgent:
        """Fork a stage's agent (``local_agent.main(argv)``) with ``env``, which must be the zygote's own."""
        assert env == self.env, "a stage whose environment differs from the zygote's is spawned"
        if self.gone:
            raise ZygoteGone("the preloaded process ended")
        read_fd, write_fd = os.pipe()
        try:
            send(self.sock, {"argv": argv, "env": env, "cwd": cwd}, fds=(write_fd,))
            reply, _ = receive(self.sock)
        except OSError as e:
            os.close(read_fd)
            self.gone = True
            raise ZygoteGone(f"the preloaded process does not answer: {e}") from e
        finally:
            os.close(write_fd)
        if reply is None:
            os.close(read_fd)
            self.gone = True
            raise ZygoteGone("the preloaded process ended")
        return ForkedAgent(self, int(reply["pid"]), os.fdopen(read_fd, "r", buffering=1, encoding="utf-8",
                                                                errors="replace"))

    def close(self) -> None:
        """Close our end (the zygote, or the shared one's handler, exits on it); kill a run's own zygote
        if it does not within 10 s."""
        import subprocess

        self.sock.close()
        if self.proc is None:   # the shared process: its handler for this run ends, the process goes on
            return
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
