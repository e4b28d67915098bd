"""``launch report RUNS_ROOT [--out DIR] [--since DATE] [--example GLOB] [--rebuild-history]``.

Reads every run under RUNS_ROOT (launcher/report/history.collect), keeps those selected, draws
each example's plots and writes ``DIR/index.html`` with ``DIR/img/*.png`` (default DIR:
RUNS_ROOT/report).  The page is built in a temporary directory beside DIR and renamed into
place; an existing DIR is replaced only when it is an earlier report (it holds ``.ptq-report``).
"""
from __future__ import annotations

import datetime as _dt
import fnmatch
import os
import re
import shutil
from typing import Optional

from launcher.contract import UserError, write_text_atomic
from launcher.report import history
from launcher.report.page import build_view, example_of, file_stem, render, run_time
from launcher.report.records import is_failure

MARKER = ".ptq-report"
INDEX = "index.html"
IMG_DIR = "img"
_DAYS = re.compile(r"^(\d+)d$")


def parse_since(text: Optional[str], now: Optional[_dt.datetime] = None) -> Optional[_dt.datetime]:
    """``YYYY-MM-DD``, an ISO date-time, or ``Nd`` (N days before now)."""
    if not text:
        return None
    m = _DAYS.match(text.strip())
    if m:
        return (now or _dt.datetime.now()) - _dt.timedelta(days=int(m.group(1)))
    try:
        return _dt.datetime.fromisoformat(text.strip()).replace(tzinfo=None)
    except ValueError:
        raise UserError(f"--since {text!r}: expected a date (2026-11-01), a date-time (2026-11-01T20:00) "
                         f"or a number of days (30d)") from None


def select(records: list[dict], since: Optional[_dt.datetime] = None, example: Optional[str] = None) -> list[dict]:
    """Records started at or after ``since`` whose job name (or example path) matches the glob(s)
    ``example`` (comma-separated)."""
    globs = [g.strip() for g in (example or "").split(",") if g.strip()]
    out = []
    for r in records:
        if since is not None:
            t = run_time(r)
            if t is None or t < since:
                continue
        if globs:
            names = [example_of(r), str(r.get("example") or "")]
            if not any(fnmatch.fnmatch(n, g) for n in names if n for g in globs):
                continue
        out.append(r)
    return sorted(out, key=lambda r: (run_time(r) or _dt.datetime.min, str(r.get("run_id"))))


def _prepare_out(out: str) -> str:
    """A fresh temporary directory next to ``out``; refuses an ``out`` that is not a report."""
    if os.path.exists(out):
        if not os.path.isdir(out):
            raise UserError(f"--out {out}: exists and is not a directory")
        if os.listdir(out) and not os.path.exists(os.path.join(out, MARKER)):
            raise UserError(f"--out {out}: exists and is not an earlier report (no {MARKER}); "
                             f"give an empty or new directory")
    tmp = f"{out.rstrip(os.sep)}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(os.path.join(tmp, IMG_DIR))
    return tmp


def _publish(tmp: str, out: str) -> None:
    if os.path.exists(out):
        old = f"{out.rstrip(os.sep)}.old-{os.getpid()}"
        os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, out)


def build_report(runs_root: str, out: Optional[str] = None, since: Optional[str] = None,
                 example: Optional[str] = None, rebuild: bool = False) -> tuple[str, list[dict], list[str]]:
    """Write the report; returns (index.html's path, the records shown, warnings)."""
    root = os.path.abspath(runs_root)
    if not os.path.isdir(root):
        raise UserError(f"{runs_root}: no such runs root (a directory of <job_name>/<run_id>/ run directories)")
    since_t = parse_since(since)
    if rebuild:
        _, records, warnings = history.rebuild_history(root)
    else:
        records, warnings = history.collect(root)
    if not records:
        raise UserError(f"{runs_root}: no runs here (no {history.HISTORY_FILE} and no run directory "
                         f"<job_name>/<run_id>/metadata.json)")
    shown = select(records, since_t, example)
    filters = " ".join(x for x in (f"since {since}" if since else "", f"example {example}" if example else "") if x)
    if not shown:
        raise UserError(f"{runs_root}: {len(records)} run(s), none selected by {filters}")
    out = os.path.abspath(out or os.path.join(root, "report"))
    tmp = _prepare_out(out)
    try:
        from launcher.report.plots import plot_example

        groups: dict[str, list[dict]] = {}
        for r in shown:
            groups.setdefault(example_of(r), []).append(r)
        plots = {name: plot_example(recs, os.path.join(tmp, IMG_DIR), file_stem(name))
                 for name, recs in groups.items()}
        for ps in plots.values():      # the page links its images relative to DIR, not to tmp
            for p in ps:
                p.path = os.path.join(out, os.path.relpath(p.path, tmp))
        view = build_view(shown, plots, out, root, filters, warnings)
        write_text_atomic(os.path.join(tmp, INDEX), render(view))
        write_text_atomic(os.path.join(tmp, MARKER), "written by `launch report`; replaced by the next one\n")
        _publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return os.path.join(out, INDEX), shown, warnings


def report_main(runs_root: str, out: Optional[str] = None, since: Optional[str] = None,
                example: Optional[str] = None, rebuild: bool = False) -> int:
    index, shown, warnings = build_report(runs_root, out, since, example, rebuild)
    for w in warnings:
        print(f"[report] warning: {w}")
    failed = sum(1 for r in shown if is_failure(r))
    examples = len({example_of(r) for r in shown})
    print(f"[report] {len(shown)} run(s) of {examples} example(s), {failed} failure(s): {index}")
    return 0
