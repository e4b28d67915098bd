"""How busy the machine's cores are while the test suite runs, per test file, and what that bounds.

    vmstat -t 5 > /tmp/vmstat.log &                     # sampled while the suite runs
    CI=true bash .ci/run                                # or: make test PYTEST_ARGS="--junitxml=/tmp/junit.xml"
    kill %1
    python3 benchmarks/suite_cpu.py --junit /tmp/ptq-junit.XXXX.xml --vmstat /tmp/vmstat.log --cores 2 \
        --out benchmarks/results/DATE-cpu-suite-utilisation.json

A serial run (``-n 0``) runs its tests one after another, in the JUnit file's order, each for its
recorded time (setup, call and teardown), from the test suite's ``timestamp``: that places every
test on the clock, and vmstat's samples (the share of the machine's cores busy in user and system
time over each interval) say how many core-seconds went by during it.  The sum over the suite is the
CPU work the suite needs on this machine; divided by the cores, it is the shortest wall any schedule
of the same work could take here (all cores busy all the time): a lower bound for pytest-xdist
workers, a rank pool or any other overlap.  A file whose utilisation is well under 1.0 waits (for
Slurm, a subprocess, a timeout) or runs on one core; only those leave room for overlap.

A run with pytest-xdist workers (``--workers N``, N > 0) runs tests side by side, so they cannot be laid
end to end: only the whole suite is measured then, from its ``timestamp`` for the suite's own ``time``
(its wall), with the same samples.  Its busy core-seconds against a serial run's show what running side
by side costs in CPU work (contention), its wall what it gains.

The vmstat interval's first line (averages since boot) is skipped; the samples cover the machine, so
run nothing else meanwhile.
"""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import os
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._common import REPO_ROOT, markdown_table, write_json  # noqa: E402


def _durations_per_file():
    """.ci/durations_per_file.py (not a package): its ``file_of`` names each test case's file."""
    spec = importlib.util.spec_from_file_location("durations_per_file",
                                                  os.path.join(REPO_ROOT, ".ci", "durations_per_file.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@dataclass(frozen=True)
class Sample:
    end: float          # epoch seconds at the end of the interval
    seconds: float      # the interval's length
    busy: float         # share of all cores busy (user + system), 0..1


def read_vmstat(path: str) -> list[Sample]:
    """``vmstat -t N`` output: one Sample per line after the first (which averages since boot)."""
    samples, previous = [], None
    with open(path) as f:
        for line in f:
            fields = line.split()
            if len(fields) < 19 or not fields[0].isdigit():
                continue
            end = datetime.datetime.fromisoformat(f"{fields[-2]} {fields[-1]}").replace(
                tzinfo=datetime.timezone.utc).timestamp()
            us, sy = int(fields[12]), int(fields[13])
            if previous is not None:
                samples.append(Sample(end, end - previous, (us + sy) / 100.0))
            previous = end
    if not samples:
        raise ValueError(f"--vmstat {path}: no samples (expected `vmstat -t N` output, two lines or more)")
    return samples


def busy_core_seconds(samples: list[Sample], start: float, end: float, cores: int) -> float:
    """Core-seconds busy between ``start`` and ``end``, each sample spread evenly over its interval."""
    total = 0.0
    for s in samples:
        lo, hi = max(start, s.end - s.seconds), min(end, s.end)
        if hi > lo:
            total += s.busy * cores * (hi - lo)
    return total


def _suite(path: str) -> tuple[ET.Element, float]:
    """The JUnit file's <testsuite> and its start (epoch seconds)."""
    root = ET.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    if suite is None or not suite.get("timestamp"):
        raise ValueError(f"--junit {path}: no <testsuite timestamp=...> (pytest --junitxml writes one)")
    start = datetime.datetime.fromisoformat(suite.get("timestamp"))
    if start.tzinfo is None:
        start = start.replace(tzinfo=datetime.timezone.utc)
    return suite, start.timestamp()


def read_junit(path: str) -> tuple[float, list[tuple[str, float]]]:
    """The suite's start (epoch seconds) and its tests in order: (file, seconds)."""
    suite, start = _suite(path)
    file_of = _durations_per_file().file_of
    tests = [(file_of(tc), float(tc.get("time", 0))) for tc in suite.iter("testcase")]
    return start, tests


def read_suite_wall(path: str) -> tuple[float, float]:
    """The suite's start (epoch seconds) and its wall (its ``time``: pytest's whole session)."""
    suite, start = _suite(path)
    if suite.get("time") is None:
        raise ValueError(f"--junit {path}: no <testsuite time=...> (pytest --junitxml writes one)")
    return start, float(suite.get("time"))


def per_file(start: float, tests: list[tuple[str, float]], samples: list[Sample], cores: int) -> dict:
    """{file: {"wall_s", "busy_core_s", "utilisation"}} with the tests laid end to end from ``start``."""
    out: dict = {}
    t = start
    for name, seconds in tests:
        row = out.setdefault(name, {"wall_s": 0.0, "busy_core_s": 0.0})
        row["wall_s"] += seconds
        row["busy_core_s"] += busy_core_seconds(samples, t, t + seconds, cores)
        t += seconds
    for row in out.values():
        row["utilisation"] = row["busy_core_s"] / (cores * row["wall_s"]) if row["wall_s"] else 0.0
    return out


def summary(files: dict, cores: int, target_s: float) -> dict:
    return summary_of(sum(r["wall_s"] for r in files.values()), sum(r["busy_core_s"] for r in files.values()),
                      cores, target_s)


def summary_of(wall: float, busy: float, cores: int, target_s: float) -> dict:
    bound = busy / cores
    return {"wall_s": round(wall, 1), "busy_core_s": round(busy, 1), "cores": cores,
            "utilisation": round(busy / (cores * wall), 3), "lower_bound_s": round(bound, 1),
            "target_s": target_s, "target_reachable_by_overlap_alone": bound <= target_s,
            "cpu_work_to_cut_for_target": round(max(0.0, 1 - target_s / bound), 3)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--junit", required=True, help="the run's JUnit XML (pytest --junitxml)")
    ap.add_argument("--vmstat", required=True, help="`vmstat -t N` sampled over the same run")
    ap.add_argument("--cores", type=int, default=os.cpu_count())
    ap.add_argument("--target-s", type=float, default=720.0, help="the test phase's goal (issue 25: 12 minutes)")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--workers", type=int, default=0,
                    help="the run's pytest-xdist workers (make test's TEST_WORKERS); > 0: the whole suite only")
    ap.add_argument("--out", help="write the figures as JSON here")
    args = ap.parse_args(argv)
    if args.cores < 1:
        ap.error(f"--cores {args.cores} must be >= 1")
    if args.workers < 0:
        ap.error(f"--workers {args.workers} must be >= 0 (0: a serial run)")
    samples = read_vmstat(args.vmstat)
    if args.workers:
        start, wall = read_suite_wall(args.junit)
        files, end = {}, start + wall
        totals = summary_of(wall, busy_core_seconds(samples, start, end, args.cores), args.cores, args.target_s)
    else:
        start, tests = read_junit(args.junit)
        end = start + sum(s for _, s in tests)
        files = per_file(start, tests, samples, args.cores)
        totals = summary(files, args.cores, args.target_s)
    first = samples[0].end - samples[0].seconds
    if first > start or samples[-1].end < end:
        print(f"warning: the vmstat samples ({first:.0f}..{samples[-1].end:.0f}) do not cover the whole suite "
              f"({start:.0f}..{end:.0f}): the uncovered part counts as idle", file=sys.stderr)
    doc = {"benchmark": "suite_cpu", "junit": args.junit, "vmstat": args.vmstat, "workers": args.workers,
           "summary": totals,
           "files": {k: {m: round(v, 2) for m, v in r.items()} for k, r in
                     sorted(files.items(), key=lambda kv: -kv[1]["wall_s"])}}
    s = doc["summary"]
    print(f"suite: {s['wall_s']:.0f} s wall, {s['busy_core_s']:.0f} core-seconds busy on {s['cores']} cores "
          f"(utilisation {s['utilisation']:.2f}); the shortest any overlap could make it: {s['lower_bound_s']:.0f} s "
          f"(target {s['target_s']:.0f} s: " + ("within reach of overlap" if s["target_reachable_by_overlap_alone"]
                                               else f"{s['cpu_work_to_cut_for_target']:.0%} of the CPU work must go")
          + ")")
    rows = [[f"{r['wall_s']:.1f}", f"{r['busy_core_s']:.1f}", f"{r['utilisation']:.2f}", name]
            for name, r in list(doc["files"].items())[:args.top]]
    if rows:
        print(markdown_table(["wall s", "busy core-s", "utilisation", "file"], rows))
    if args.out:
        write_json(args.out, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
