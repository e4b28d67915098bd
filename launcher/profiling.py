"""Where a stage's time goes, by Python's profiler: ``PTQ_PROFILE=export`` (or ``quantize,export``...).

Set in the environment of ``launch`` (the executors pass it on to every rank), it wraps each named
stage's work on every rank in ``cProfile`` and writes, per rank, beside the stage's log:

    <run>/<stage>/profile-rank<R>.pstats   the raw profile (``python -m pstats`` reads it)
    <run>/<stage>/profile-rank<R>.txt      the 40 costliest functions by cumulative time, then by own time

cProfile sees Python calls and the C functions they make (a CUDA kernel launch, a ``.cpu()`` copy that
waits for the GPU, a file write), so host-bound work such as an exporter's per-weight loop shows where
it waits.  Off by default; a stage not named is not touched.  Lazy: importing this module costs nothing.
"""
from __future__ import annotations

import contextlib
import io
import os
from typing import Iterator, Mapping

from launcher.contract import STAGE_ORDER, RunLayout

ENV = "PTQ_PROFILE"
TOP = 40


def stages_to_profile(env: Mapping[str, str] = os.environ) -> frozenset[str]:
    """The stages named in ``PTQ_PROFILE`` (comma-separated); ValueError naming the valid ones."""
    names = [s.strip() for s in env.get(ENV, "").split(",") if s.strip()]
    bad = [s for s in names if s not in STAGE_ORDER]
    if bad:
        raise ValueError(f"{ENV}={env.get(ENV)!r}: unknown stage(s) {bad}; valid: {', '.join(STAGE_ORDER)}")
    return frozenset(names)


def profile_paths(run_dir: str, stage: str, rank: int) -> tuple[str, str]:
    base = RunLayout(run_dir).profile_base(stage, rank)
    return base + ".pstats", base + ".txt"


def summary(profile, top: int = TOP) -> str:
    """The ``top`` costliest functions by cumulative time, then by own (total) time, as pstats prints
    them; ``profile``: a ``cProfile.Profile`` or the path of a dumped one."""
    import pstats

    out = io.StringIO()
    stats = pstats.Stats(profile, stream=out)
    stats.strip_dirs()
    for key in ("cumulative", "tottime"):
        out.write(f"==== by {key} ====\n")
        stats.sort_stats(key).print_stats(top)
    return out.getvalue()


@contextlib.contextmanager
def maybe_profile(stage: str, rank: int, run_dir: str, env: Mapping[str, str] = os.environ) -> Iterator[bool]:
    """Profile the block when ``stage`` is named in ``PTQ_PROFILE``; yields whether it does.  The files
    are written even when the block raises (the profile of a failed stage says where it was)."""
    if stage not in stages_to_profile(env):
        yield False
        return
    import cProfile

    profile = cProfile.Profile()
    profile.enable()
    try:
        yield True
    finally:
        profile.disable()
        raw, text = profile_paths(run_dir, stage, rank)
        os.makedirs(os.path.dirname(raw), exist_ok=True)
        profile.dump_stats(raw)
        with open(text, "w") as f:
            f.write(summary(profile))
