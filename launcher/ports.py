"""A free TCP port for a rendezvous that another process binds later (a stage's master port).

Binding port 0 and closing the socket gives an *ephemeral* port, and the kernel may hand that port to
any outgoing connection in the seconds before the rank binds it: the rank then fails with EADDRINUSE
(seen under two pytest workers: ``test_preflight_every_stage_on_gloo``, 11 s between the choice and
the bind). A port below the ephemeral range (``/proc/sys/net/ipv4/ip_local_port_range``) is never
handed out that way. ``free_port`` draws one at random from ``[LOW, ephemeral start)`` and checks
that nothing holds it now; where the range leaves no room it falls back to port 0's answer.

``LOW`` keeps clear of the ports that Slurm jobs derive from their job id (``slurm_env``: 20000 plus
the id modulo 20000), for the ids a cluster hands out first.
"""
from __future__ import annotations

import random
import socket

LOW = 24000
RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"


def ephemeral_start(path: str = RANGE_FILE) -> int:
    """The first port of the kernel's ephemeral range (Linux's default 32768 where it cannot be read)."""
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def free_port(rng: random.Random | None = None, tries: int = 200, range_file: str = RANGE_FILE) -> int:
    """A port nothing holds now, outside the ephemeral range where the system allows it."""
    rng = rng or random.SystemRandom()
    top = ephemeral_start(range_file)
    if top - LOW >= 100:
        for _ in range(tries):
            port = rng.randrange(LOW, top)
            if _bindable(port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:   # no room below the range: port 0's answer
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
