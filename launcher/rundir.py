"""The run directory: resolved config, metadata.json, per-stage manifests (no torch).

    <runs_root>/<job_name>/<run_id>/config.yaml     resolved config, secrets masked
                                   metadata.json   run id, job, note, per-stage status and timings, versions
                                   <stage>/manifest.json  written by the stage's rank 0 on success

A stage's manifest records ``stage_config_hash``: the hash of everything that determines its
output (model, recipe, seed and every stage up to it), and ``outputs``: every file the stage
published under <stage>/ with its size and sha256.  ``--resume`` skips a stage whose manifest
matches the current config and reruns the rest.  A manifest means the stage's work completed; the
job's final state (metadata.json) is the executor's word on the job.  When the two disagree (Slurm
declared NODE_FAIL after rank 0 wrote the manifest), ``--resume`` re-verifies the outputs against
the manifest (``verify_outputs``) before it skips the stage.
"""
from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import platform
import secrets as _secrets
import shutil
import time
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

from launcher.contract import (
    MASK, STAGE_ORDER, RunLayout, StageStatus, UserError, is_secret, write_json_atomic, write_text_atomic)

# statuses in metadata.json
PENDING, RUNNING, COMPLETED, FAILED, SKIPPED, DISABLED, CANCELLED = (
    StageStatus.PENDING, StageStatus.RUNNING, StageStatus.COMPLETED, StageStatus.FAILED, StageStatus.SKIPPED,
    StageStatus.DISABLED, StageStatus.CANCELLED)


def new_run_id() -> str:
    return _dt.datetime.now().strftime("%Y%m%d-%H%M%S-") + _secrets.token_hex(2)


def masked_config(cfg: DictConfig) -> DictConfig:
    data = OmegaConf.to_container(cfg, resolve=True)
    for key in list(data.get("env", {})):
        if is_secret(key):
            data["env"][key] = MASK
    return OmegaConf.create(data)


def stage_config_hash(cfg: DictConfig, stage: str) -> str:
    """Hash of what determines `stage`'s output: model, recipe, seed, stages up to `stage`.

    Executor, job name, note, test level and runs_root do not change outputs and are left out;
    `enabled` flags are left out too (a disabled upstream stage contributes nothing).
    """
    assert stage in STAGE_ORDER, stage
    data = OmegaConf.to_container(cfg, resolve=True)
    upstream = {}
    for s in STAGE_ORDER[: STAGE_ORDER.index(stage) + 1]:
        part = dict(data["stages"][s])
        enabled = part.pop("enabled", True)
        part.pop("disabled_reason", None)
        upstream[s] = part if enabled else None
    payload = {"model": data["model"], "recipe": data["recipe"], "seed": data["seed"], "stages": upstream}
    blob = json.dumps(payload, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def read_json(path: str) -> Optional[dict]:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def launcher_versions() -> dict[str, str]:
    from importlib import metadata

    out = {"python": platform.python_version()}
    for dist in ("ptq-launcher", "hydra-core", "omegaconf", "submitit"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return out


class RunDirectory:
    def __init__(self, path: str):
        self.path = os.path.abspath(path)
        self.layout = RunLayout(self.path)

    @classmethod
    def create(cls, cfg: DictConfig, run_id: Optional[str] = None) -> "RunDirectory":
        run_id = run_id or new_run_id()
        path = os.path.join(os.path.abspath(cfg.runs_root), cfg.job_name, run_id)
        os.makedirs(path, exist_ok=False)
        rd = cls(path)
        rd.write_config(cfg)
        stages = {s: {"status": PENDING if cfg.stages[s].enabled else DISABLED} for s in STAGE_ORDER}
        for s in STAGE_ORDER:
            reason = cfg.stages[s].get("disabled_reason") if not cfg.stages[s].enabled else None
            if reason:
                stages[s]["reason"] = reason
        rd.write_metadata({
            "run_id": run_id, "job_name": cfg.job_name, "note": cfg.note, "allow_to_fail": cfg.allow_to_fail,
            "test_level": cfg.test_level, "created": _dt.datetime.now().isoformat(timespec="seconds"),
            "executor": cfg.executor.kind, "status": PENDING, "stages": stages, "versions": launcher_versions(),
        })
        return rd

    @property
    def run_id(self) -> str:
        return os.path.basename(self.path)

    def config_path(self) -> str:
        return self.layout.config_yaml

    def write_config(self, cfg: DictConfig) -> None:
        write_text_atomic(self.config_path(), OmegaConf.to_yaml(masked_config(cfg)))

    def stage_dir(self, stage: str) -> str:
        return self.layout.stage_dir(stage)

    def is_run_directory(self) -> bool:
        return os.path.isfile(self.layout.metadata_json)

    # -- metadata -------------------------------------------------------------------------
    def metadata(self) -> dict[str, Any]:
        """metadata.json; UserError naming the file when it is not what a run writes (hand-edited,
        truncated by a full disk, another tool's file)."""
        path = self.layout.metadata_json
        try:
            data = read_json(path)
        except (ValueError, UnicodeDecodeError) as e:
            raise UserError(f"{path}: not valid JSON ({e}): not a run directory this launcher wrote, or a "
                            "damaged one") from e
        if data is None:
            raise UserError(f"{self.path}: not a run directory (no metadata.json)")
        if not isinstance(data, dict) or not isinstance(data.get("stages"), dict):
            raise UserError(f"{path}: lacks 'stages' (a mapping); valid metadata.json has run_id, job_name and "
                            "stages {name: {status, ...}}")
        return data

    def write_metadata(self, data: dict[str, Any]) -> None:
        write_json_atomic(self.layout.metadata_json, data)

    def update_stage(self, stage: str, **fields: Any) -> None:
        data = self.metadata()
        entry = data["stages"].setdefault(stage, {})
        if fields.get("status") == RUNNING:
            entry.pop("reason", None)
            entry["started"] = time.time()
        if fields.get("status") in (COMPLETED, FAILED, CANCELLED) and "started" in entry:
            entry["duration_s"] = round(time.time() - entry["started"], 2)
        entry.update(fields)
        self.write_metadata(data)

    def update_run(self, **fields: Any) -> None:
        data = self.metadata()
        data.update(fields)
        self.write_metadata(data)

    # -- manifests ------------------------------------------------------------------------
    def manifest(self, stage: str) -> Optional[dict]:
        return read_json(self.layout.manifest(stage))

    def stage_is_current(self, cfg: DictConfig, stage: str) -> bool:
        m = self.manifest(stage)
        return bool(m) and m.get("status") == COMPLETED and m.get("stage_config_hash") == stage_config_hash(cfg, stage)

    def verify_outputs(self, stage: str) -> list[str]:
        """Problems with the outputs ``stage``'s manifest lists (empty: every file is there, same size
        and sha256, and nothing else was published beside them)."""
        return verify_outputs(self.stage_dir(stage), self.manifest(stage) or {})

    def set_aside_outputs(self, stage: str) -> list[str]:
        """Before a stage whose outputs failed re-verification is redone: remove its manifest and
        rename each published top-level entry to ``<entry>.stale`` (kept for inspection; an older
        ``.stale`` is replaced).  Returns the new names."""
        d = self.stage_dir(stage)
        try:
            os.remove(self.layout.manifest(stage))
        except FileNotFoundError:
            pass
        moved = []
        for top in sorted({rel.split("/")[0] for rel in list_outputs(d)}):
            src, dst = os.path.join(d, top), os.path.join(d, top + STALE_SUFFIX)
            if os.path.isdir(dst):
                shutil.rmtree(dst)
            elif os.path.exists(dst):
                os.remove(dst)
            os.replace(src, dst)
            moved.append(dst)
        return moved


# -- a stage's published outputs ----------------------------------------------------------------------
# not outputs: what the executor and the worker write beside them, and what a stage leaves aside
NOT_OUTPUTS = ("log.txt", "manifest.json")
NOT_OUTPUT_PREFIXES = (RunLayout.PROFILE_PREFIX,)   # PTQ_PROFILE's files (launcher.profiling), every rank's
STALE_SUFFIX = ".stale"
_ASIDE_SUFFIXES = (".rejected", STALE_SUFFIX)
_HASH_CHUNK = 8 << 20


def _is_output(rel: str) -> bool:
    parts = rel.split("/")
    if rel in NOT_OUTPUTS or rel.startswith(NOT_OUTPUT_PREFIXES):
        return False
    # temporary names of atomic writes (<name>.tmp-<pid>, export's <name>.tmp-export) and set-aside entries
    return not any(".tmp-" in p or p.endswith(_ASIDE_SUFFIXES) for p in parts)


def list_outputs(stage_dir: str) -> list[str]:
    """Relative paths ('/'-separated, sorted) of every published file under ``stage_dir``."""
    out = []
    for root, dirs, files in os.walk(stage_dir):
        dirs.sort()
        for name in files:
            rel = os.path.relpath(os.path.join(root, name), stage_dir).replace(os.sep, "/")
            if _is_output(rel):
                out.append(rel)
    return sorted(out)


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            chunk = f.read(_HASH_CHUNK)
            if not chunk:
                return h.hexdigest()
            h.update(chunk)


def describe_outputs(stage_dir: str) -> dict[str, dict]:
    """{relative path: {size, sha256}} of the stage's published files: what the manifest records."""
    return {rel: {"size": os.path.getsize(os.path.join(stage_dir, rel)),
                  "sha256": file_sha256(os.path.join(stage_dir, rel))} for rel in list_outputs(stage_dir)}


def verify_outputs(stage_dir: str, manifest: dict) -> list[str]:
    """Re-check the files a manifest lists: each exists with its recorded size and sha256, and no
    other file was published beside them.  Returns the problems (empty: verified)."""
    listed = manifest.get("outputs")
    if not isinstance(listed, dict):
        return ["the manifest lists no outputs (written by an older launcher): cannot re-verify"]
    problems = []
    for rel, want in sorted(listed.items()):
        path = os.path.join(stage_dir, rel)
        if not os.path.isfile(path):
            problems.append(f"{rel}: missing")
        elif os.path.getsize(path) != want.get("size"):
            problems.append(f"{rel}: {os.path.getsize(path)} bytes, the manifest says {want.get('size')}")
        elif file_sha256(path) != want.get("sha256"):
            problems.append(f"{rel}: sha256 differs from the manifest's")
    problems += [f"{rel}: not in the manifest" for rel in list_outputs(stage_dir) if rel not in listed]
    return problems


def write_manifest(run_dir: str, cfg: DictConfig, stage: str, extra: Optional[dict] = None) -> None:
    """Called by a stage's rank 0 after every rank completed the stage's work (worker): the config
    hash and the listing of the outputs (size, sha256) that ``--resume`` can re-verify."""
    layout = RunLayout(run_dir)
    t = time.time()
    outputs = describe_outputs(layout.stage_dir(stage))
    data = {"stage": stage, "status": COMPLETED, "stage_config_hash": stage_config_hash(cfg, stage),
            "finished": _dt.datetime.now().isoformat(timespec="seconds"), "outputs": outputs,
            "outputs_hash_s": round(time.time() - t, 2)}
    data.update(extra or {})
    write_json_atomic(layout.manifest(stage), data)


def remove_manifest(run_dir: str, stage: str) -> None:
    """Called by a stage's rank 0 before the stage's work: a manifest only ever describes the
    latest attempt that completed, never an earlier one beside a newer attempt's outputs."""
    try:
        os.remove(RunLayout(run_dir).manifest(stage))
    except FileNotFoundError:
        pass
