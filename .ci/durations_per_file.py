#!/usr/bin/env python3
"""Total test time per file, from pytest's --junitxml report (stdlib only).

    python3 .ci/durations_per_file.py REPORT.xml [--top N]

Each <testcase> carries its file (``file`` attribute, or its ``classname`` ``tests.test_x[.Class]``)
and its time: setup + call + teardown (pytest's default ``junit_duration_report = total``).  Prints
one line per file, slowest first: total seconds, share of the whole, tests, failed/skipped counts.
"""
from __future__ import annotations

import argparse
import collections
import sys
import xml.etree.ElementTree as ET


def file_of(case: ET.Element) -> str:
    if case.get("file"):
        return case.get("file")
    parts = (case.get("classname") or "?").split(".")
    # tests.test_x or tests.test_x.TestClass: the module is the last part that starts with test_
    mods = [i for i, p in enumerate(parts) if p.startswith("test_") or p == "conftest"]
    return "/".join(parts[: mods[-1] + 1]) + ".py" if mods else ".".join(parts)


def per_file(path: str) -> dict[str, dict]:
    out: dict[str, dict] = collections.defaultdict(lambda: {"s": 0.0, "tests": 0, "failed": 0, "skipped": 0})
    for case in ET.parse(path).getroot().iter("testcase"):
        row = out[file_of(case)]
        row["s"] += float(case.get("time") or 0)
        row["tests"] += 1
        row["failed"] += any(case.find(k) is not None for k in ("failure", "error"))
        row["skipped"] += case.find("skipped") is not None
    return dict(out)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("report")
    ap.add_argument("--top", type=int, default=0, help="only the N slowest files (default: all)")
    args = ap.parse_args(argv)
    try:
        rows = per_file(args.report)
    except (OSError, ET.ParseError) as e:
        print(f"[ci] no per-file durations: {e}", file=sys.stderr)
        return 1
    total = sum(r["s"] for r in rows.values()) or 1.0
    ordered = sorted(rows.items(), key=lambda kv: -kv[1]["s"])
    if args.top:
        ordered = ordered[: args.top]
    print(f"[ci] total per file ({len(rows)} files, {sum(r['tests'] for r in rows.values())} tests, "
          f"{total:.1f} s of test time):")
    for name, r in ordered:
        extra = "".join(f", {r[k]} {k}" for k in ("failed", "skipped") if r[k])
        print(f"[ci] {r['s']:9.1f} s {100 * r['s'] / total:5.1f}%  {r['tests']:4d} tests{extra:<22}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
