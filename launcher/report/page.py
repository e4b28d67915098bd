"""The report page's content (pure Python) and its rendering (jinja2, templates/report.html.j2).

The page, top to bottom: the failures (newest first, each with its error lines and links to its
run directory and the failed stage's log), the latest run per example with the figures that
decide pass or fail (each check marked pass/fail in words as well as colour), then per example
its plots and a table of every run.  No JavaScript: links, tables and <details> only.
"""
from __future__ import annotations

import datetime as _dt
import os
import re
from dataclasses import dataclass, field
from typing import Any, Optional

from launcher.contract import StageStatus
from launcher.report.records import FAILED_STAGE, INTERRUPTED, is_failure

TEMPLATE = "report.html.j2"
MAX_FAILURES = 25
_RUN_ID_TIME = re.compile(r"^(\d{8}-\d{6})")


def run_time(record: dict) -> Optional[_dt.datetime]:
    """When the run started: metadata's ``created``, else the date-time its default run id starts with."""
    for text in (record.get("created"), record.get("started")):
        if isinstance(text, str):
            try:
                return _dt.datetime.fromisoformat(text).replace(tzinfo=None)
            except ValueError:
                pass
    m = _RUN_ID_TIME.match(str(record.get("run_id") or ""))
    return _dt.datetime.strptime(m.group(1), "%Y%m%d-%H%M%S") if m else None


def example_of(record: dict) -> str:
    return str(record.get("job_name") or "?")


def file_stem(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_") or "example"


def fmt(v: Any, digits: int = 4) -> str:
    if isinstance(v, bool) or v is None:
        return "" if v is None else str(v).lower()
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def fmt_interval(pair: Any, digits: int = 4) -> str:
    if isinstance(pair, (list, tuple)) and len(pair) == 2 and None not in pair:
        return f"[{pair[0]:.{digits}f}, {pair[1]:.{digits}f}]"
    return ""


@dataclass
class Check:
    """One figure that decides pass or fail, as a table cell."""

    value: str
    limit: str = ""
    state: str = "info"          # pass | fail | info | none
    note: str = ""

    @property
    def mark(self) -> str:
        return {"pass": "\u2713 ", "fail": "\u2717 "}.get(self.state, "")


@dataclass
class RunView:
    record: dict
    example: str
    when: str
    link: Optional[str]          # the run directory, relative to the page; None when it is gone
    log_link: Optional[str]      # the failed stage's log.txt
    status: str
    failed_stage: Optional[str]
    checks: dict[str, Check] = field(default_factory=dict)
    stage_times: str = ""
    since_fixed: bool = False
    failed: bool = False          # is_failure(record)
    anchor: str = ""              # the example's section


def _rel(path: Optional[str], out_dir: str) -> Optional[str]:
    if not path or not os.path.exists(path):
        return None
    return os.path.relpath(path, out_dir).replace(os.sep, "/")


def checks_of(record: dict) -> dict[str, Check]:
    gate, export, vllm = record.get("gate") or {}, record.get("export") or {}, record.get("vllm_smoke") or {}
    stages = record.get("stages") or {}

    def status(stage: str) -> str:          # what a stage without results did: disabled, not_run, ...
        return str((stages.get(stage) or {}).get("status") or "").replace("_", " ")

    out: dict[str, Check] = {}
    acc, bound = gate.get("accuracy"), gate.get("lower_bound")
    if acc is None:
        out["accuracy"] = Check(status("mmlu"), state="none")
    else:
        state = "info" if bound is None else ("pass" if acc >= bound else "fail")
        out["accuracy"] = Check(f"{acc:.4f} {fmt_interval(gate.get('interval'))}",
                                "" if bound is None else f"\u2265 {bound:g}", state)
    drop, max_drop = gate.get("drop"), gate.get("max_drop")
    if drop is None:
        out["drop"] = Check("", state="none")
    else:
        state = "info" if max_drop is None else ("pass" if drop <= max_drop + 1e-12 else "fail")
        out["drop"] = Check(f"{drop:+.4f} {fmt_interval(gate.get('drop_interval'))}",
                            "" if max_drop is None else f"\u2264 {max_drop:g}", state)
    out["baseline"] = Check(fmt(gate.get("baseline_accuracy")), state="info")
    out["kl"] = Check(fmt(gate.get("mean_kl"), 5), state="info")
    out["agreement"] = Check(fmt(gate.get("agreement")), state="info")
    if not export:
        out["export"] = Check(status("export"), state="none")
    else:
        ok = export.get("ok")
        ratio = export.get("size_ratio")
        out["export"] = Check(("verified" if ok else "unverified" if ok is None else "rejected")
                              + (f", {ratio:.3f}\u00d7 bf16" if ratio is not None else ""),
                              state="pass" if ok else "fail" if ok is False else "info")
    if not vllm:
        out["vllm"] = Check(status("vllm_smoke"), state="none")
    elif vllm.get("skipped") is not None:
        out["vllm"] = Check("skipped", state="info", note=vllm["skipped"])
    else:
        agree, min_agree = vllm.get("agreement"), vllm.get("min_agreement")
        out["vllm"] = Check(f"agreement {fmt(agree, 3)}" if agree is not None else "generation only",
                            "" if min_agree is None else f"\u2265 {min_agree:g}",
                            "pass" if vllm.get("passed") else "fail")
    return out


def run_view(record: dict, out_dir: str) -> RunView:
    stages = record.get("stages") or {}
    failed = next((n for n, s in stages.items() if (s or {}).get("status") in FAILED_STAGE), None)
    if failed is None and record.get("status") == INTERRUPTED:
        failed = next((n for n, s in stages.items()
                       if (s or {}).get("status") in (StageStatus.RUNNING, StageStatus.SUBMITTED)), None)
    run_dir = record.get("run_dir")
    log = os.path.join(run_dir, failed, "log.txt") if run_dir and failed else None
    when = run_time(record)
    times = ", ".join(f"{n} {s['duration_s']:.0f}s" for n, s in stages.items()
                      if isinstance((s or {}).get("duration_s"), (int, float)))
    status = str(record.get("status") or "?")
    if status == "completed" and is_failure(record):
        status = "completed (a check failed)"
    return RunView(record=record, example=example_of(record), when=when.strftime("%Y-%m-%d %H:%M") if when else "?",
                   link=_rel(run_dir, out_dir), log_link=_rel(log, out_dir), status=status, failed_stage=failed,
                   checks=checks_of(record), stage_times=times, failed=is_failure(record),
                   anchor="ex-" + file_stem(example_of(record)))


@dataclass
class ExampleView:
    name: str
    anchor: str
    runs: list[RunView]                 # newest first
    plots: list[dict]                   # {title, src, alt, empty}
    failures: int = 0


@dataclass
class PageView:
    title: str
    runs_root: str
    generated: str
    filters: str
    n_runs: int
    failures: list[RunView]
    failures_hidden: int
    latest: list[RunView]
    examples: list[ExampleView]
    warnings: list[str]


def build_view(records: list[dict], plots_by_example: dict[str, list], out_dir: str, runs_root: str,
               filters: str, warnings: list[str]) -> PageView:
    """``records`` oldest first; ``plots_by_example``: launcher.report.plots.Plot lists."""
    views = [run_view(r, out_dir) for r in records]
    by_example: dict[str, list[RunView]] = {}
    for v in views:
        by_example.setdefault(v.example, []).append(v)
    for runs in by_example.values():
        passed_later = False
        for v in reversed(runs):
            if is_failure(v.record):
                v.since_fixed = passed_later
            else:
                passed_later = True
    failures = [v for v in reversed(views) if is_failure(v.record)]
    examples = []
    for name in sorted(by_example):
        runs = by_example[name]
        plots = [{"title": p.title, "src": os.path.relpath(p.path, out_dir).replace(os.sep, "/"),
                  "alt": f"{p.title} over {len(runs)} run(s) of {name}" + (f": {p.empty}" if p.empty else ""),
                  "empty": p.empty, "kind": p.kind} for p in plots_by_example.get(name, [])]
        examples.append(ExampleView(name=name, anchor="ex-" + file_stem(name), runs=list(reversed(runs)),
                                    plots=plots, failures=sum(is_failure(v.record) for v in runs)))
    # failing examples first, in the table and in the sections below it
    examples.sort(key=lambda e: (not is_failure(e.runs[0].record), e.name))
    latest = [e.runs[0] for e in examples]
    return PageView(title="PTQ nightly report", runs_root=os.path.abspath(runs_root),
                    generated=_dt.datetime.now().strftime("%Y-%m-%d %H:%M"), filters=filters,
                    n_runs=len(records), failures=failures[:MAX_FAILURES],
                    failures_hidden=max(0, len(failures) - MAX_FAILURES), latest=latest, examples=examples,
                    warnings=warnings)


def render(view: PageView) -> str:
    import jinja2

    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(os.path.join(os.path.dirname(os.path.abspath(__file__)), "templates")),
        autoescape=True, undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    env.filters["fmt"] = fmt
    return env.get_template(TEMPLATE).render(page=view)
