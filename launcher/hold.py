"""A test hook: hold a stage's ranks at a named point until a file appears (off by default).

``PTQ_TEST_HOLD=STAGE:POINT:RELEASE_FILE`` in the environment of ``launch`` (Slurm forwards it to
the job, the local agent to its ranks) makes every rank of STAGE, on reaching POINT, create
``RELEASE_FILE.held-r<rank>`` and wait until RELEASE_FILE exists.  A test waits for all of the
``held`` markers, injects its fault with the stage known to be at that point, then creates
RELEASE_FILE (or never does).  The points, in the worker (launcher/worker.py):

    start  process groups are up and the preflight passed on every rank; no output written yet
    end    the stage's work is done: every output is published and rank 0 has written the manifest

A rank that is not released within ``PTQ_TEST_HOLD_TIMEOUT_S`` (default 3600 s) fails the stage.
It is no config key: config validation refuses ``env.PTQ_TEST_HOLD`` (launcher.config.validate),
so a pipeline config can never hold its own stages.  Without the variable ``at`` returns at once.
"""
from __future__ import annotations

import os
import time
from typing import Mapping, Optional

ENV = "PTQ_TEST_HOLD"
TIMEOUT_ENV = "PTQ_TEST_HOLD_TIMEOUT_S"
POINTS = ("start", "end")
POLL_S = 0.1


class HoldTimeout(RuntimeError):
    pass


def parse(value: str) -> tuple[str, str, str]:
    """'STAGE:POINT:FILE' -> (stage, point, file); the file may itself contain ':'."""
    parts = value.split(":", 2)
    if len(parts) != 3 or not all(parts):
        raise ValueError(f"{ENV}={value!r}: expected STAGE:POINT:RELEASE_FILE")
    stage, point, path = parts
    if point not in POINTS:
        raise ValueError(f"{ENV}={value!r}: point {point!r} is not one of {', '.join(POINTS)}")
    return stage, point, path


def marker(release_file: str, rank: int) -> str:
    return f"{release_file}.held-r{rank}"


def at(stage: str, point: str, rank: int, environ: Optional[Mapping[str, str]] = None,
       log=None) -> bool:
    """Hold here if the environment asks for (stage, point); returns whether it held."""
    environ = os.environ if environ is None else environ
    value = environ.get(ENV)
    if not value:
        return False
    want_stage, want_point, release = parse(value)
    if (want_stage, want_point) != (stage, point):
        return False
    timeout_s = float(environ.get(TIMEOUT_ENV) or 3600)
    with open(marker(release, rank), "w") as f:
        f.write(f"{os.getpid()}\n")
    if log:
        log(f"{ENV}: rank {rank} held at {stage}:{point} until {release} exists")
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(release):
        if time.monotonic() > deadline:
            raise HoldTimeout(f"{ENV}: {stage}:{point} not released ({release}) within {timeout_s:.0f} s")
        time.sleep(POLL_S)
    return True
