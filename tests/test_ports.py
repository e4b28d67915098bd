"""launcher.ports.free_port: a stage's master port is drawn below the kernel's ephemeral range (so no
outgoing connection can take it before the rank binds it), never one that is held, and port 0's answer
where the range leaves no room."""
from __future__ import annotations

import random
import socket

from launcher.ports import LOW, ephemeral_start, free_port


class _Sequence(random.Random):
    def __init__(self, ports):
        super().__init__(0)
        self.ports = list(ports)

    def randrange(self, lo, hi):
        port = self.ports.pop(0)
        assert lo <= port < hi, (lo, port, hi)
        return port


def test_the_port_is_below_the_ephemeral_range_and_free(tmp_path):
    ranges = tmp_path / "range"
    ranges.write_text("32768\t60999\n")
    assert ephemeral_start(str(ranges)) == 32768
    for _ in range(20):
        port = free_port(range_file=str(ranges))
        assert LOW <= port < 32768
        with socket.socket() as s:
            s.bind(("", port))


def test_a_held_port_is_skipped(tmp_path):
    ranges = tmp_path / "range"
    ranges.write_text("40000 60999\n")
    held = socket.socket()
    held.bind(("", 0))
    held.listen()
    try:
        port = held.getsockname()[1]
        if not LOW <= port < 40000:           # an ephemeral port above the range: hold one inside it
            held.close()
            held = socket.socket()
            held.bind(("", 39999))
            held.listen()
            port = 39999
        assert free_port(rng=_Sequence([port, 39998]), range_file=str(ranges)) == 39998
    finally:
        held.close()


def test_no_room_below_the_range_falls_back_to_an_ephemeral_port(tmp_path):
    ranges = tmp_path / "range"
    ranges.write_text(f"{LOW + 50} 60999\n")
    port = free_port(range_file=str(ranges))
    assert port >= ephemeral_start()     # the real range's: what binding port 0 gives
    assert ephemeral_start(str(tmp_path / "absent")) == 32768
