"""One run directory -> one history record: a small JSON dict (pure Python, no torch).

The record holds what the report plots and what decides pass or fail, read from the files the
product writes (metadata.json: launcher/rundir.py; mmlu/results.json: launcher/stages/mmlu.py;
export/verify.json: launcher/stages/export.py; vllm_smoke/responses.json or skip.json:
launcher/stages/vllm_smoke.py; quantize/summary.json's versions).  Any of them may be missing or
unreadable - a run that crashed mid-way - and the record is still well formed: its fields are
None and ``errors`` says what is missing.  A run whose metadata.json still says a stage is
running (or pending) when the record is made has ``status: interrupted``.
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import re
import subprocess
from typing import Any, Optional

from launcher.contract import STAGE_ORDER, RunLayout, StageName, StageStatus

SCHEMA = 1
INTERRUPTED = "interrupted"
UNFINISHED = (StageStatus.RUNNING, StageStatus.PENDING, StageStatus.SUBMITTED)
FAILED_STAGE = (StageStatus.FAILED, StageStatus.CANCELLED)
FINAL = (StageStatus.COMPLETED, StageStatus.FAILED, StageStatus.CANCELLED)
MAX_ERRORS = 12
MAX_LOG_LINES = 4
_LOG_ERROR = re.compile(r"(STAGE FAILED|PREFLIGHT FAILED|Traceback|Error:|error:|FAILED)")
_RANK_PREFIX = re.compile(r"^\[[\w-]+ r\d+\]\s*")


def _read_json(path: str, errors: list[str], what: str) -> Optional[dict]:
    try:
        with open(path) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else None
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        errors.append(f"{what} unreadable: {type(e).__name__}: {e}")
        return None


def _num(v: Any) -> Optional[float]:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _pair(v: Any) -> Optional[list[float]]:
    if isinstance(v, (list, tuple)) and len(v) == 2 and all(_num(x) is not None for x in v):
        return [float(v[0]), float(v[1])]
    return None


def _iso(v: Any) -> Optional[str]:
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return _dt.datetime.fromtimestamp(v).isoformat(timespec="seconds")
    return v if isinstance(v, str) else None


def launcher_commit() -> Optional[str]:
    """The launcher's commit: $PTQ_COMMIT, else ``git`` in the launcher's checkout (+ "-dirty")."""
    if os.environ.get("PTQ_COMMIT"):
        return os.environ["PTQ_COMMIT"]
    src = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        head = subprocess.run(["git", "-C", src, "rev-parse", "--short=12", "HEAD"], capture_output=True,
                              text=True, timeout=10)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", src, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return head.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.TimeoutExpired):
        return None


def _recipe_name(layout: RunLayout, errors: list[str]) -> Optional[str]:
    try:
        import yaml

        with open(layout.config_yaml) as f:
            cfg = yaml.safe_load(f) or {}
        return (cfg.get("recipe") or {}).get("name")
    except FileNotFoundError:
        return None
    except Exception as e:  # noqa: BLE001 - a broken config.yaml is recorded, not raised
        errors.append(f"config.yaml unreadable: {type(e).__name__}: {e}")
        return None


def gate_fields(results: Optional[dict]) -> Optional[dict]:
    """What the report needs of mmlu/results.json (launcher/mmlu/results.build_results)."""
    if not results:
        return None
    base = results.get("baseline") or {}
    paired = base.get("paired") or {}
    return {
        "accuracy": _num(results.get("accuracy")), "n": results.get("n"), "correct": results.get("correct"),
        "interval": _pair(results.get("interval")), "interval_method": results.get("interval_method"),
        "lower_bound": _num(results.get("lower_bound")), "max_drop": _num(results.get("max_drop")),
        "baseline_mode": base.get("mode"), "baseline_accuracy": _num(base.get("accuracy")),
        "drop": _num(base.get("drop")), "drop_interval": _pair(paired.get("interval")),
        "drop_method": paired.get("method"), "p_value": _num(paired.get("p_value")),
        "mean_kl": _num(results.get("mean_kl")), "agreement": _num(results.get("agreement")),
        "pass": results.get("pass"), "failures": list(results.get("failures") or []),
        "warnings": list(results.get("warnings") or []),
    }


def export_fields(verify: Optional[dict]) -> Optional[dict]:
    """What the report needs of export/verify.json (launcher/stages/export.py)."""
    if not verify:
        return None
    size = verify.get("size") or {}
    return {"ok": verify.get("ok"), "size_ratio": _num(size.get("ratio_vs_bf16")),
            "export_bytes": size.get("export_bytes"), "errors": list(verify.get("errors") or [])[:5],
            "skipped": verify.get("skipped")}


def vllm_fields(responses: Optional[dict], skip: Optional[dict]) -> Optional[dict]:
    """vllm_smoke/responses.json (SmokeRecord) or skip.json (launcher/stages/vllm_smoke.py)."""
    if responses:
        crit = responses.get("criteria") or {}
        return {"passed": responses.get("passed"), "agreement": _num(responses.get("agreement")),
                "accuracy": _num(responses.get("accuracy")), "min_agreement": _num(crit.get("min_agreement")),
                "failures": list(responses.get("failures") or []), "skipped": None}
    if skip:
        return {"passed": None, "agreement": None, "accuracy": None, "min_agreement": None, "failures": [],
                "skipped": skip.get("reason", "")}
    return None


def log_error_lines(path: str, limit: int = MAX_LOG_LINES) -> list[str]:
    """A failed stage's error lines from its log.txt: every rank prints the same STAGE FAILED line,
    so they are de-duplicated without their ``[stage rN]`` prefix."""
    try:
        with open(path, errors="replace") as f:
            lines = f.read().splitlines()[-4000:]
    except OSError:
        return []
    out: list[str] = []
    for line in lines:
        if _LOG_ERROR.search(line) and not line.lstrip().startswith("Traceback"):
            text = _RANK_PREFIX.sub("", line.strip())[:400]
            if text and text not in out:
                out.append(text)
    return out[-limit:]


def _add(errors: list[str], line: str) -> None:
    """Append ``line`` unless an earlier line already says it (the text after its ``where: ``)."""
    line = line.strip()
    text = line.split(": ", 1)[-1]
    if line and not any(text in e for e in errors):
        errors.append(line)


def record_from_run_dir(run_dir: str, example: Optional[str] = None, commit: Optional[str] = None,
                        source: str = "rundir") -> dict:
    """The history record of one run directory; never raises for missing or broken files."""
    layout = RunLayout(os.path.abspath(run_dir))
    errors: list[str] = []
    meta = _read_json(layout.metadata_json, errors, "metadata.json")
    if meta is None and not any("metadata.json" in e for e in errors):
        errors.append("metadata.json missing: the run stopped before its run directory was written")
    meta = meta or {}
    stages_meta = meta.get("stages") if isinstance(meta.get("stages"), dict) else {}
    stages: dict[str, dict] = {}
    for name in [*STAGE_ORDER, *[s for s in stages_meta if s not in STAGE_ORDER]]:
        st = stages_meta.get(name)
        if not isinstance(st, dict):
            continue
        entry = {"status": st.get("status"), "duration_s": _num(st.get("duration_s"))}
        for key in ("reason", "exit_code"):
            if st.get(key) not in (None, ""):
                entry[key] = st[key]
        stages[name] = entry

    results = _read_json(layout.mmlu_results, errors, "mmlu/results.json")
    verify = _read_json(layout.export_verify, errors, "export/verify.json")
    responses = _read_json(layout.vllm_responses, errors, "vllm_smoke/responses.json")
    skip = _read_json(layout.skip(StageName.VLLM_SMOKE), errors, "vllm_smoke/skip.json")
    summary = _read_json(layout.quantize_summary, errors, "quantize/summary.json") or {}
    gate, export, vllm = gate_fields(results), export_fields(verify), vllm_fields(responses, skip)

    status = meta.get("status")
    if status not in FINAL:
        # the launcher writes a final status before it exits (Ctrl-C included): without one the run
        # crashed, was killed - or, for a record made from the directory, may still be running
        where = next((n for n, st in stages.items() if st["status"] in UNFINISHED and st["status"] != StageStatus.PENDING),
                     next((n for n, st in stages.items() if st["status"] == StageStatus.PENDING), None))
        what = f"{where} was {stages[where]['status']}" if where else "no stage had started"
        _add(errors, f"interrupted: {what} when this record was made (the launcher crashed or was killed, "
                     f"or is still running)")
        status = INTERRUPTED
    for name, st in stages.items():
        if st["status"] in FAILED_STAGE:
            _add(errors, f"{name}: {st['status']}" + (f" - {st['reason']}" if st.get("reason") else ""))
            for line in (stages_meta[name].get("errors") or [])[:5]:
                _add(errors, f"{name}: {line}")
            for line in log_error_lines(layout.log(name)):
                _add(errors, f"{name}: {line}")
    for line in (gate or {}).get("failures", []):
        _add(errors, f"mmlu gate: {line}")
    if export and export.get("ok") is False:
        for line in export["errors"]:
            _add(errors, f"export verify: {line}")
    for line in (vllm or {}).get("failures", []):
        _add(errors, f"vllm_smoke: {line}")

    versions = {k: v for k, v in {**(summary.get("versions") or {}), **(meta.get("versions") or {})}.items()
                if v is not None}
    return {
        "schema": SCHEMA, "source": source, "recorded": _dt.datetime.now().isoformat(timespec="seconds"),
        "run_id": meta.get("run_id") or os.path.basename(layout.path),
        "job_name": meta.get("job_name") or os.path.basename(os.path.dirname(layout.path)),
        "example": example, "run_dir": layout.path, "created": meta.get("created"),
        "started": _iso(meta.get("started")), "ended": _iso(meta.get("ended")),
        "status": status, "exit_code": meta.get("exit_code"), "executor": meta.get("executor"),
        "allow_to_fail": meta.get("allow_to_fail"), "note": meta.get("note"),
        "recipe": _recipe_name(layout, errors), "commit": commit or meta.get("commit"), "versions": versions,
        "stages": stages, "gate": gate, "export": export, "vllm_smoke": vllm, "errors": errors[:MAX_ERRORS],
    }


def is_failure(record: dict) -> bool:
    """A run the page lists among the failures: it failed, was cancelled or interrupted, or a check
    in it failed (an allow_to_fail gate included)."""
    if record.get("status") in (StageStatus.FAILED, StageStatus.CANCELLED, INTERRUPTED):
        return True
    if any((s or {}).get("status") in FAILED_STAGE for s in (record.get("stages") or {}).values()):
        return True
    gate, export, vllm = record.get("gate") or {}, record.get("export") or {}, record.get("vllm_smoke") or {}
    return gate.get("pass") is False or export.get("ok") is False or vllm.get("passed") is False
