"""A stage's step timings: ``{step name: seconds}``, as its report records them.

    timings = Timings()
    with timings.measure("build_s"):
        model = build_model(...)
    timings["build_s"]        # seconds, rounded to ``digits`` (None: not rounded)

A step that raises records nothing.  ``since(name, start)`` records the seconds since ``start``;
``total(name)`` the seconds since the Timings was made.
"""
from __future__ import annotations

import contextlib
import time
from typing import Iterator, Optional


class Timings(dict):
    def __init__(self, digits: Optional[int] = 2) -> None:
        super().__init__()
        self.digits = digits
        self.started = time.time()

    def _seconds(self, since: float) -> float:
        s = time.time() - since
        return s if self.digits is None else round(s, self.digits)

    @contextlib.contextmanager
    def measure(self, name: str) -> Iterator[None]:
        t = time.time()
        yield
        self[name] = self._seconds(t)

    def since(self, name: str, start: float) -> float:
        """Record the seconds since ``start`` (a ``time.time()``) as ``name``."""
        self[name] = self._seconds(start)
        return self[name]

    def total(self, name: str = "total_s") -> float:
        self[name] = self._seconds(self.started)
        return self[name]
