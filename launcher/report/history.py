"""``<runs_root>/history.jsonl``: one record per run (launcher/report/records.py), one JSON line each.

Appending is atomic: under an exclusive lock (``history.jsonl.lock``) the file is rewritten
whole to a temporary name, fsync'ed and renamed into place, so a reader - or a crash at any
moment - sees the old file or the new one, never half a line.  Readers skip a line that does
not parse (a file edited by hand, a disk that lost data) with a warning instead of failing.

``collect(root)`` is what the report reads: the records of every run directory under ``root``
(read afresh: a resumed run's directory is newer than its record), plus the history's records of
runs whose directories are gone (nightly jobs delete checkpoints).  ``rebuild_history(root)``
writes that union back to the file.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import sys
from typing import Iterator, Optional

from launcher.contract import UserError
from launcher.report.records import SCHEMA, launcher_commit, record_from_run_dir

HISTORY_FILE = "history.jsonl"
MAX_DEPTH = 3          # <root>/<job>/<run>, or <root>/<suite-root>/<job>/<run>
STAGE_DIRS = {"quantize", "mmlu", "export", "vllm_smoke", "slurm"}


def history_path(runs_root: str) -> str:
    return os.path.join(os.path.abspath(runs_root), HISTORY_FILE)


def run_key(record: dict) -> tuple[str, str]:
    return (str(record.get("job_name")), str(record.get("run_id")))


@contextlib.contextmanager
def _locked(path: str) -> Iterator[None]:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _write_atomic(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _encode(record: dict) -> bytes:
    return (json.dumps(record, default=str, separators=(",", ":")) + "\n").encode()


def append_record(runs_root: str, record: dict) -> str:
    """Append ``record`` to ``<runs_root>/history.jsonl`` atomically; returns the file's path."""
    path = history_path(runs_root)
    line = _encode(record)
    with _locked(path):
        try:
            with open(path, "rb") as f:
                old = f.read()
        except FileNotFoundError:
            old = b""
        if old and not old.endswith(b"\n"):
            old += b"\n"
        _write_atomic(path, old + line)
    return path


def append_run(runs_root: str, run_dir: str, example: Optional[str] = None) -> dict:
    """Record ``run_dir`` (just finished, or crashed) in the history of ``runs_root``."""
    record = record_from_run_dir(run_dir, example=example, commit=launcher_commit(), source="append")
    append_record(runs_root, record)
    return record


def append_run_or_warn(runs_root: str, run_dir: str, example: Optional[str] = None) -> Optional[dict]:
    """``append_run`` for ``launch`` and ``launch suite``: a history that cannot be written is a
    warning on stderr, never the run's failure."""
    try:
        record = append_run(runs_root, run_dir, example)
    except Exception as e:  # noqa: BLE001 - the run's own exit code must survive a broken history
        print(f"[launch] warning: history not written to {history_path(runs_root)}: {e}", file=sys.stderr)
        return None
    print(f"[launch] history: {record['status']} run {record['run_id']} appended to {history_path(runs_root)}",
          flush=True)
    return record


def read_history(path: str) -> tuple[list[dict], list[str]]:
    """(records, warnings) of a history file; a missing file is empty."""
    records, warnings = [], []
    try:
        with open(path, "rb") as f:
            lines = f.read().decode("utf-8", errors="replace").splitlines()
    except FileNotFoundError:
        return [], []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            warnings.append(f"{path} line {n}: not a JSON record (skipped)")
            continue
        if not isinstance(rec, dict) or "run_id" not in rec or not isinstance(rec.get("schema"), int):
            warnings.append(f"{path} line {n}: not a history record (skipped)")
        elif rec["schema"] > SCHEMA:
            warnings.append(f"{path} line {n}: schema {rec['schema']} is newer than this launcher's {SCHEMA} (skipped)")
        else:
            records.append(rec)
    return records, warnings


def find_run_dirs(root: str, max_depth: int = MAX_DEPTH) -> list[str]:
    """Run directories (a metadata.json beside a config.yaml, or a metadata.json alone) under
    ``root``, without descending into run directories or their stages."""
    found = []

    def walk(path: str, depth: int) -> None:
        try:
            entries = sorted(os.scandir(path), key=lambda e: e.name)
        except OSError:
            return
        for e in entries:
            if not e.is_dir(follow_symlinks=False) or e.name.startswith(".") or e.name in STAGE_DIRS:
                continue
            if os.path.isfile(os.path.join(e.path, "metadata.json")):
                found.append(os.path.abspath(e.path))
            elif depth < max_depth:
                walk(e.path, depth + 1)

    walk(root, 1)
    return found


def history_files(root: str) -> list[str]:
    """``root``'s history.jsonl and those of runs roots one level below (nightly suite roots)."""
    paths = [history_path(root)]
    try:
        paths += sorted(os.path.join(e.path, HISTORY_FILE) for e in os.scandir(root) if e.is_dir())
    except OSError:
        pass
    return [p for p in paths if os.path.isfile(p)]


def collect(root: str) -> tuple[list[dict], list[str]]:
    """(records, warnings): every run under ``root``, one record each, oldest first."""
    if not os.path.isdir(root):
        raise UserError(f"{root}: no such runs root (a directory of <job_name>/<run_id>/ run directories)")
    by_key: dict[tuple[str, str], dict] = {}
    warnings: list[str] = []
    for path in history_files(root):
        recs, warns = read_history(path)
        warnings += warns
        for rec in recs:
            by_key[run_key(rec)] = rec          # the last record of a run wins
    for run_dir in find_run_dirs(root):
        rec = record_from_run_dir(run_dir)
        old = by_key.get(run_key(rec))
        if old:                                  # what the directory cannot say: how it was launched
            for key in ("example", "commit"):
                rec[key] = rec.get(key) or old.get(key)
            if not rec.get("versions"):
                rec["versions"] = old.get("versions") or {}
        by_key[run_key(rec)] = rec
    records = sorted(by_key.values(), key=lambda r: (str(r.get("created") or ""), str(r.get("run_id"))))
    return records, warnings


def rebuild_history(root: str) -> tuple[str, list[dict], list[str]]:
    """Rewrite ``<root>/history.jsonl`` from the run directories under ``root`` (keeping the
    records of runs whose directories are gone); returns (path, records, warnings)."""
    records, warnings = collect(root)
    path = history_path(root)
    with _locked(path):
        _write_atomic(path, b"".join(_encode(r) for r in records))
    return path, records, warnings
