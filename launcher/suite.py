"""`launch suite EXAMPLES_DIR`: the nightly run of every example, with JUnit XML and Markdown.

Each example whose `test_level` is at most N runs through `launch` (in a subprocess, on this
machine's executor) when this machine can run it; the others are validated and dry-run, and the
report says why they were not run.  Failures of `allow_to_fail` examples are reported without
failing the suite.  No torch is imported here.
"""
from __future__ import annotations

import fnmatch
import glob
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Optional
from xml.etree import ElementTree as ET

from launcher.architectures import ARCHITECTURES
from launcher.config.compose import ConfigError, compose_example
from launcher.config.validate import validate
from launcher.contract import RunLayout, StageName, UserError
from launcher.hf_config import read_hf_config_if_present
from launcher.rundir import read_json
from launcher.schema import enabled_stages
from launcher.topology import ParallelDims


@dataclass
class ExampleOutcome:
    path: str
    job_name: str = ""
    status: str = "pending"       # passed | failed | allowed_failure | dry_run | invalid | skipped
    reason: str = ""
    duration_s: float = 0.0
    run_dir: str = ""
    allow_to_fail: bool = False
    stages: list[dict] = field(default_factory=list)


def gpu_count() -> int:
    if not shutil.which("nvidia-smi"):
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def why_not_runnable(cfg, gpus: int) -> Optional[str]:
    """None when this machine can run the example, else the reason."""
    if read_hf_config_if_present(cfg.model.path) is None:
        return f"checkpoint not on this machine ({cfg.model.path})"
    arch = ARCHITECTURES.get(cfg.model.architecture)
    if gpus == 0 and arch is not None and arch.gpu_only:
        return f"{arch.name} needs a GPU ({arch.gpu_only}); this machine has no GPU"
    if gpus and cfg.executor.device != "cpu":
        need = max(ParallelDims.from_stage(cfg, s).world_size for s in enabled_stages(cfg))
        if need > gpus:
            return f"needs {need} GPUs, this machine has {gpus}"
    try:
        validate(cfg, check_paths=True)
    except ConfigError as e:
        return f"inputs missing here: {str(e).splitlines()[1].strip()}"
    return None


def run_suite(examples_dir: str, test_level: int = 0, junit: Optional[str] = None, summary: Optional[str] = None,
              overrides: list[str] = (), runs_root: Optional[str] = None, exclude: list[str] = ()) -> int:
    """``exclude``: glob patterns of example paths (as given, e.g. ``examples/tiny/NemotronH*``)
    reported as skipped instead of run."""
    paths = sorted(glob.glob(os.path.join(examples_dir, "**", "*.yaml"), recursive=True))
    if not paths:
        raise UserError(f"no example YAML under {examples_dir}")
    runs_root, overrides = suite_runs_root(list(overrides), runs_root)
    gpus = gpu_count()
    outcomes = []
    for path in paths:
        hit = next((p for p in exclude if fnmatch.fnmatch(path, p) or fnmatch.fnmatch(os.path.relpath(path), p)), None)
        if hit:
            outcomes.append(ExampleOutcome(path=path, status="skipped", reason=f"excluded by --exclude {hit}"))
        else:
            outcomes.append(_one_example(path, test_level, gpus, list(overrides), runs_root))
        o = outcomes[-1]
        print(f"[suite] {o.status:<15} {os.path.relpath(path)}" + (f" - {o.reason}" if o.reason else ""), flush=True)
    summary = summary or (os.path.splitext(junit)[0] + ".md" if junit else None)
    if junit:
        write_junit(outcomes, junit)
    md = markdown_summary(outcomes)
    if summary:
        with open(summary, "w") as f:
            f.write(md)
    print(md)
    return 1 if any(o.status in ("failed", "invalid") for o in outcomes) else 0


def suite_runs_root(overrides: list[str], runs_root: Optional[str]) -> tuple[str, list[str]]:
    """The suite's runs root and the overrides left for every example.

    A ``runs_root=X`` override is the runs root (the suite passes it to every example itself);
    ``--runs-root`` (``runs_root``) says the same; both, disagreeing, is an error.  Default:
    ./runs/suite-<time>."""
    given = [o.split("=", 1)[1] for o in overrides if o.lstrip("+").startswith("runs_root=")]
    rest = [o for o in overrides if not o.lstrip("+").startswith("runs_root=")]
    if given and runs_root and os.path.abspath(given[-1]) != os.path.abspath(runs_root):
        raise UserError(f"runs_root={given[-1]} and --runs-root {runs_root} disagree: give one of them")
    root = runs_root or (given[-1] if given else os.path.join("runs", "suite-" + time.strftime("%Y%m%d-%H%M%S")))
    return os.path.abspath(root), rest


def _one_example(path: str, test_level: int, gpus: int, overrides: list[str], runs_root: str) -> ExampleOutcome:
    out = ExampleOutcome(path=path)
    try:
        cfg = compose_example(path, overrides + [f"runs_root={runs_root}"])
        out.job_name, out.allow_to_fail = cfg.job_name, bool(cfg.allow_to_fail)
        validate(cfg, check_paths=False)
    except ConfigError as e:
        out.status, out.reason = "invalid", str(e)
        return out
    if cfg.test_level > test_level:
        out.status, out.reason = "skipped", f"test_level {cfg.test_level} > {test_level}"
        return out
    reason = why_not_runnable(cfg, gpus)
    cmd = [sys.executable, "-m", "launcher.cli", path, *overrides, f"runs_root={runs_root}"]
    t0 = time.time()
    if reason:
        dry = subprocess.run(cmd + ["--dry-run", "--json"], capture_output=True, text=True)
        out.duration_s = time.time() - t0
        if dry.returncode != 0:
            out.status, out.reason = "invalid", dry.stderr.strip()[-500:]
            return out
        out.status, out.reason = "dry_run", reason
        out.stages = [{"name": s["name"], "status": "planned" if s["enabled"] else "disabled"}
                      for s in json.loads(dry.stdout)["stages"]]
        return out
    proc = subprocess.run(cmd)
    out.duration_s = time.time() - t0
    job_dir = os.path.join(runs_root, cfg.job_name)
    runs = sorted(os.listdir(job_dir)) if os.path.isdir(job_dir) else []
    out.run_dir = os.path.join(job_dir, runs[-1]) if runs else ""
    if out.run_dir:   # one record per run in <runs_root>/history.jsonl, for `launch report`
        from launcher.report.history import append_run_or_warn

        append_run_or_warn(runs_root, out.run_dir, example=os.path.relpath(path))
    meta = read_json(RunLayout(out.run_dir).metadata_json) if out.run_dir else None
    results = read_json(RunLayout(out.run_dir).mmlu_results) if out.run_dir else None
    for name, st in (meta or {}).get("stages", {}).items():
        entry = {"name": name, "status": st.get("status"), "duration_s": st.get("duration_s"), "reason": st.get("reason", "")}
        if name == StageName.MMLU and results:
            entry.update(accuracy=results.get("accuracy"), bound=results.get("lower_bound"))
        out.stages.append(entry)
    if proc.returncode == 0:
        out.status = "passed"
    else:
        out.status = "allowed_failure" if out.allow_to_fail else "failed"
        failed = [s for s in out.stages if s["status"] == "failed"]
        out.reason = f"exit {proc.returncode}" + (f" in {failed[0]['name']}: {failed[0]['reason']}" if failed else "")
    return out


def write_junit(outcomes: list[ExampleOutcome], path: str) -> None:
    suite = ET.Element("testsuite", name="ptq-examples", tests=str(len(outcomes)),
                       failures=str(sum(o.status == "failed" for o in outcomes)),
                       errors=str(sum(o.status == "invalid" for o in outcomes)),
                       skipped=str(sum(o.status in ("skipped", "dry_run") for o in outcomes)))
    for o in outcomes:
        case = ET.SubElement(suite, "testcase", classname="examples", name=os.path.relpath(o.path),
                             time=f"{o.duration_s:.1f}")
        if o.status == "failed":
            ET.SubElement(case, "failure", message=o.reason).text = json.dumps(o.stages, indent=1)
        elif o.status == "invalid":
            ET.SubElement(case, "error", message=o.reason[:200]).text = o.reason
        elif o.status in ("skipped", "dry_run"):
            ET.SubElement(case, "skipped", message=f"{o.status}: {o.reason}")
        elif o.status == "allowed_failure":
            ET.SubElement(case, "system-out").text = f"allowed to fail: {o.reason}"
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    ET.ElementTree(suite).write(path, encoding="utf-8", xml_declaration=True)


def markdown_summary(outcomes: list[ExampleOutcome]) -> str:
    lines = ["| example | stage | status | accuracy | bound | duration (s) | note |", "|---|---|---|---|---|---|---|"]
    for o in outcomes:
        name = os.path.relpath(o.path)
        lines.append(f"| {name} | (all) | {o.status} |  |  | {o.duration_s:.1f} | {o.reason} |")
        for s in o.stages:
            acc = f"{s['accuracy']:.4f}" if isinstance(s.get("accuracy"), (int, float)) else ""
            bound = s.get("bound") if s.get("bound") is not None else ""
            dur = f"{s['duration_s']:.1f}" if isinstance(s.get("duration_s"), (int, float)) else ""
            lines.append(f"| {name} | {s['name']} | {s['status']} | {acc} | {bound} | {dur} | {s.get('reason', '')} |")
    return "\n".join(lines) + "\n"
