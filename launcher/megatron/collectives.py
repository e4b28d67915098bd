"""Object collectives over ``torch.distributed``: the launcher's one place for ``dist.*_object``.

* ``broadcast(value)``: rank 0's ``value`` on every rank;
* ``all_gather(value)``: every rank's ``value``, in rank order, on every rank;
* ``gather_to_rank0(value, rank)``: every rank's ``value`` on rank 0 (None elsewhere);
* ``long_wait_group(wait_s)``: a gloo group of all ranks whose collectives wait ``wait_s`` seconds,
  for the ranks that wait while rank 0 works alone (hashing a checkpoint, verifying an export),
  longer than the stage's collective timeout allows; destroyed when the block ends;
* ``on_rank0(fn, rank, wait_s=None)``: run ``fn`` on rank 0 and give every rank ``(result, error)``,
  so that a failure on rank 0 fails every rank instead of leaving them waiting.

Without an initialized process group (one process) each is the identity: the value, ``[value]``,
or ``fn()`` run here.  Every rank of the group must make the same calls in the same order.
"""
from __future__ import annotations

import contextlib
import datetime
from typing import Any, Callable, Iterator, Optional

LONG_WAIT_S = 6 * 3600


def _dist():
    import torch.distributed as dist

    return dist if dist.is_initialized() else None


def _world(group=None) -> int:
    dist = _dist()
    return 1 if dist is None else dist.get_world_size(group)


def broadcast(value: Any, group=None) -> Any:
    """Rank 0's ``value`` (global rank 0, a member of ``group``) on every rank of ``group``."""
    if _world(group) == 1:
        return value
    box = [value]
    _dist().broadcast_object_list(box, src=0, group=group)
    return box[0]


def all_gather(value: Any, group=None) -> list:
    """Every rank's ``value``, in rank order, on every rank."""
    world = _world(group)
    if world == 1:
        return [value]
    out = [None] * world
    _dist().all_gather_object(out, value, group=group)
    return out


def gather_to_rank0(value: Any, rank: int) -> Optional[list]:
    """Every rank's ``value``, in rank order, on rank 0; None on the other ranks."""
    world = _world()
    if world == 1:
        return [value]
    box = [None] * world if rank == 0 else None
    _dist().gather_object(value, box, dst=0)
    return box if rank == 0 else None


@contextlib.contextmanager
def long_wait_group(wait_s: float = LONG_WAIT_S) -> Iterator[Any]:
    """A gloo group of every rank whose collectives time out after ``wait_s`` seconds (None without
    a process group); destroyed on exit."""
    dist = _dist()
    group = None if dist is None else dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=wait_s))
    try:
        yield group
    finally:
        if group is not None:
            dist.destroy_process_group(group)


def on_rank0(fn: Callable[[], Any], rank: int, wait_s: Optional[float] = None,
             errors: tuple[type[BaseException], ...] = (Exception,)) -> tuple[Any, Optional[str]]:
    """Run ``fn`` on rank 0; every rank gets ``(result, None)``, or ``(None, "Type: message")`` when
    ``fn`` raised one of ``errors`` (others propagate on rank 0).  ``wait_s``: the other ranks wait
    on a ``long_wait_group`` of that timeout (made before ``fn`` starts), not on the default group's."""
    with contextlib.ExitStack() as stack:
        group = None if wait_s is None else stack.enter_context(long_wait_group(wait_s))
        result, error = None, None
        if rank == 0:
            try:
                result = fn()
            except errors as e:
                error = f"{type(e).__name__}: {e}"
        return broadcast((result, error), group)
