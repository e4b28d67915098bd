"""Start a command in its own process group, logging to a file; stop it and every descendant.

vLLM's server forks an engine-core process (and TP workers); killing only the parent would
leave them holding memory and ports.  ``stop`` signals the whole process group, then any
recorded descendant that left the group, SIGTERM first and SIGKILL after a grace period.
An atexit hook stops whatever is still running when the interpreter exits.
"""
from __future__ import annotations

import atexit
import os
import signal
import subprocess
import time
from typing import Optional, Sequence

_LIVE: set["GroupProcess"] = set()


def _children_of() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # field 4 (ppid) comes after the ")" that closes the command name
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        kids.setdefault(ppid, []).append(int(name))
    return kids


def descendants(pid: int) -> list[int]:
    """All live descendants of ``pid`` (Linux /proc; empty elsewhere)."""
    if not os.path.isdir("/proc"):
        return []
    tree, out, todo = _children_of(), [], [pid]
    while todo:
        for c in tree.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class GroupProcess:
    """A subprocess in a new session (its own process group), stdout+stderr appended to a log."""

    def __init__(self, cmd: Sequence[str], log_path: str, env: Optional[dict] = None,
                 cwd: Optional[str] = None):
        self.cmd = list(cmd)
        self.log_path = log_path
        os.makedirs(os.path.dirname(log_path) or ".", exist_ok=True)
        self._log = open(log_path, "ab", buffering=0)
        self._log.write(f"\n$ {' '.join(self.cmd)}\n".encode())
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=env, cwd=cwd,
                                     start_new_session=True)
        self.pid = self.proc.pid
        self.pgid = self.pid
        self._seen: set[int] = set()
        _LIVE.add(self)

    def poll(self) -> Optional[int]:
        if self.proc.poll() is None:
            self._seen.update(descendants(self.pid))   # remember children while the parent lives
        return self.proc.returncode

    def wait(self, timeout: float) -> Optional[int]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.poll() is not None:
                return self.proc.returncode
            time.sleep(0.5)
        return None

    def stop(self, grace_s: float = 15.0) -> list[int]:
        """Stop the group and every descendant; returns the PIDs that needed SIGKILL."""
        if self.proc.poll() is None:
            self._seen.update(descendants(self.pid))
        targets = {self.pid, *self._seen}
        self._signal_all(targets, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            self.proc.poll()
            if not any(_alive(p) for p in targets):
                break
            time.sleep(0.2)
        killed = [p for p in targets if _alive(p)]
        if killed:
            self._signal_all(targets, signal.SIGKILL)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in targets) and time.monotonic() < deadline:
            time.sleep(0.1)
        self._log.close()
        _LIVE.discard(self)
        return killed

    def _signal_all(self, pids: set[int], sig: int) -> None:
        try:
            os.killpg(self.pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        for p in pids:
            try:
                os.kill(p, sig)
            except (ProcessLookupError, PermissionError):
                pass


def log_tail(path: str, n: int = 40) -> list[str]:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 256 * 1024))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return []
    return lines[-n:]


_ERROR_MARKERS = ("Error:", "Error(", "Exception:", "error:", "Illegal instruction",
                  "Traceback", "Killed")


# vLLM's API server ends a failed engine start with this line; the cause is the engine's own error
_WRAPPER = "See root cause above"


def error_line(lines: Sequence[str]) -> Optional[str]:
    """The most telling error line of a log: the last line naming an error or exception, or, when that
    is vLLM's wrapper ("Engine core initialization failed. See root cause above"), the last error
    line before it (the engine's own)."""
    wrapper = None
    for ln in reversed(lines):
        s = ln.strip()
        if any(m in s for m in _ERROR_MARKERS) and not s.startswith("Traceback"):
            if _WRAPPER not in s:
                return s
            wrapper = wrapper or s
    return wrapper


@atexit.register
def _stop_all() -> None:
    for p in list(_LIVE):
        try:
            p.stop(grace_s=5.0)
        except Exception:
            pass
