"""Build a directory once, under a lock, and publish it whole: the tiny models' and SmolLM2's builds.

    target = locked_build(target, lambda: is_current(target), lambda tmp: build_into(tmp, ...), force=force)

* ``is_current()`` true (and not ``force``): ``target`` is returned as it is, without the lock;
* otherwise, under an fcntl lock on ``<parent>/.<name>.lock``: ``is_current()`` is asked again
  (another process may have built it meanwhile, so concurrent callers build once); the leftovers
  of a killed builder (``.<name>.tmp-*``, ``.<name>.old-*``: only lock holders create these) are
  removed; ``build(tmp)`` fills a fresh temporary sibling ``.<name>.tmp-*`` (mode 0755), which is
  renamed into place, a previous ``target`` moved aside first and removed after.
Nobody ever sees a half-built directory; a build that raises leaves nothing behind.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Iterator


def read_build_info(out_dir: str | os.PathLike) -> dict | None:
    """``<out_dir>/build.json``, or None when it is missing or not JSON."""
    try:
        with open(Path(out_dir) / "build.json", encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """An exclusive fcntl lock on the file ``path`` (created, with its folder, if missing)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def lock_path(target: Path) -> Path:
    """The lock every builder of ``target`` takes: ``<parent>/.<name>.lock``."""
    return target.parent / f".{target.name}.lock"


def holds_lock(path: Path) -> bool:
    """Whether another process holds the exclusive fcntl lock on the file ``path`` now."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(f.fileno(), fcntl.LOCK_UN)
        return False


def locked_build(target: Path, is_current: Callable[[], bool], build: Callable[[Path], object], *,
                 force: bool = False) -> Path:
    """``target``, built by ``build(tmp)`` unless ``is_current()`` (see the module's docstring)."""
    if target.exists() and not target.is_dir():
        raise ValueError(f"{target} exists and is not a directory")
    if not force and is_current():
        return target
    with locked(lock_path(target)):
        if not force and is_current():   # another process built it meanwhile
            return target
        for stale in list(target.parent.glob(f".{target.name}.tmp-*")) + list(target.parent.glob(f".{target.name}.old-*")):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            os.chmod(tmp, 0o755)
            build(tmp)
            old = None
            if target.exists():
                old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
                os.rename(target, old / "d")
            os.rename(tmp, target)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target
