"""Ordered stages over one run directory: plan, run, resume, stop on failure (no torch).

quantize -> mmlu -> export -> vllm_smoke.  A failed stage (a gate below its bound included)
stops the pipeline unless `allow_to_fail`; `--resume RUN_DIR` skips stages whose manifest
matches the current config and reruns the rest (and everything after the first rerun).
"""
from __future__ import annotations

import json
import os
import sys
import time
from typing import Optional

from omegaconf import DictConfig

from launcher.config.validate import enabled_stages, stage_dims
from launcher.contract import (
    EXIT_REASONS, STAGE_ORDER, ExitCode, JobState, RunLayout, StageName, StageStatus, split_secrets)
from launcher.executors.base import StagePlan
from launcher.rundir import RunDirectory, read_json

QUIET_WARNINGS = "ignore::FutureWarning,ignore::DeprecationWarning,ignore::UserWarning"


def stage_plan(cfg: DictConfig, stage: str, run_dir: str, python: Optional[str] = None,
               preflight_only: bool = False) -> StagePlan:
    dims = stage_dims(cfg, stage)
    argv = [python or sys.executable, "-m", "launcher.worker", stage, run_dir]
    if preflight_only:
        argv.append("--preflight-only")
    plain_env, _ = split_secrets(dict(cfg.env))
    # Megatron/ModelOpt/torch emit hundreds of Future/User warnings per rank; the user's own
    # PYTHONWARNINGS (env or `env.PYTHONWARNINGS=...`) wins.
    plain_env = {"PYTHONWARNINGS": os.environ.get("PYTHONWARNINGS", QUIET_WARNINGS), **plain_env}
    return StagePlan(name=stage, world_size=dims.world_size, argv=argv, env=plain_env,
                     log_path=RunLayout(run_dir).log(stage), allow_to_fail=bool(cfg.allow_to_fail))


def build_plans(cfg: DictConfig, run_dir: str, python: Optional[str] = None,
                preflight_only: bool = False, stages: Optional[list[str]] = None) -> list[StagePlan]:
    """Plans for `stages` (default: every enabled stage); Slurm ranks use executor.python."""
    if python is None and cfg.executor.kind == "slurm":
        python = cfg.executor.python
    stages = enabled_stages(cfg) if stages is None else stages
    return [stage_plan(cfg, s, run_dir, python, preflight_only) for s in stages]


def make_executor(cfg: DictConfig, run_dir: str):
    if cfg.executor.kind == "local":
        from launcher.executors.local import LocalExecutor

        return LocalExecutor(cfg.executor, run_dir)
    from launcher.executors.slurm import SlurmExecutor

    return SlurmExecutor(cfg.executor, run_dir)


def _export_secrets(cfg: DictConfig) -> None:
    """Secrets reach ranks through the environment (inherited), never through files."""
    _, secret_env = split_secrets(dict(cfg.env))
    os.environ.update(secret_env)


def stages_to_run(cfg: DictConfig, run: RunDirectory, resume: bool) -> list[str]:
    """Enabled stages minus those a resume may skip (up to the first one that must rerun)."""
    todo = enabled_stages(cfg)
    if not resume:
        return todo
    out, rerun = [], False
    for s in todo:
        if not rerun and run.stage_is_current(cfg, s):
            run.update_stage(s, status=StageStatus.SKIPPED, reason="resume: manifest matches the config")
            print(f"[launch] {s}: skipped (resume: manifest matches the config)", flush=True)
            continue
        rerun = True
        out.append(s)
    return out


def _record_stage_outcome(run: RunDirectory, stage: str, state: str, exit_code: int) -> str:
    """metadata.json for a finished stage; returns its status word."""
    skip = read_json(run.layout.skip(stage))
    if state == JobState.COMPLETED and skip:
        run.update_stage(stage, status=StageStatus.SKIPPED, reason=skip.get("reason", ""), exit_code=exit_code)
        print(f"[launch] {stage}: SKIPPED - {skip.get('reason', '')}", flush=True)
        return StageStatus.SKIPPED
    status = {JobState.COMPLETED: StageStatus.COMPLETED, JobState.FAILED: StageStatus.FAILED,
              JobState.CANCELLED: StageStatus.CANCELLED}.get(state, state.lower())
    fields = {"status": status, "exit_code": exit_code, "state": state}
    if state != JobState.COMPLETED:
        fields["reason"] = EXIT_REASONS.get(exit_code, f"exit code {exit_code}")
    run.update_stage(stage, **fields)
    return status


def run_pipeline(cfg: DictConfig, run: RunDirectory, resume: bool = False, preflight_only: bool = False,
                 detach: bool = False) -> int:
    """Run every enabled stage; returns the process exit code for `launch`."""
    _export_secrets(cfg)
    todo = enabled_stages(cfg) if preflight_only else stages_to_run(cfg, run, resume)
    plans = build_plans(cfg, run.path, preflight_only=preflight_only, stages=todo)
    run.update_run(status=StageStatus.RUNNING, started=time.time())
    if cfg.executor.kind == "slurm":
        return _run_slurm(cfg, run, plans, detach)
    return _run_local(cfg, run, plans, preflight_only)


def _run_local(cfg: DictConfig, run: RunDirectory, plans: list[StagePlan], preflight_only: bool) -> int:
    executor = make_executor(cfg, run.path)
    final_code = 0
    for i, plan in enumerate(plans):
        what = "preflight" if preflight_only else "running"
        print(f"[launch] {plan.name}: {what} on {plan.world_size} local rank(s) -> {plan.log_path}", flush=True)
        run.update_stage(plan.name, status=StageStatus.RUNNING, world_size=plan.world_size)
        result = executor.run_stage(plan)
        status = _record_stage_outcome(run, plan.name, result.state, result.exit_code)
        print(f"[launch] {plan.name}: {status} in {result.duration_s:.1f}s (exit {result.exit_code})", flush=True)
        if result.state == JobState.CANCELLED:
            _mark_not_run(run, [p.name for p in plans[i + 1:]], "cancelled")
            run.update_run(status=StageStatus.CANCELLED, ended=time.time())
            return ExitCode.CANCELLED
        if result.state != JobState.COMPLETED:
            final_code = result.exit_code or ExitCode.FAILED
            if not cfg.allow_to_fail:
                _mark_not_run(run, [p.name for p in plans[i + 1:]], f"{plan.name} failed")
                break
    run.update_run(status=StageStatus.COMPLETED if final_code == 0 else StageStatus.FAILED, ended=time.time(),
                   exit_code=final_code)
    _print_summary(run)
    return final_code


def _mark_not_run(run: RunDirectory, stages: list[str], why: str) -> None:
    for s in stages:
        run.update_stage(s, status=StageStatus.NOT_RUN, reason=why)
        print(f"[launch] {s}: not run ({why})", flush=True)


def _run_slurm(cfg: DictConfig, run: RunDirectory, plans: list[StagePlan], detach: bool) -> int:
    executor = make_executor(cfg, run.path)
    job_ids = executor.submit(plans)
    for plan, job in zip(plans, job_ids):
        run.update_stage(plan.name, status=StageStatus.SUBMITTED, job_id=job)
        print(f"[launch] {plan.name}: submitted as Slurm job {job}", flush=True)
    if detach:
        print(f"[launch] detached; follow with: launch status {run.path}", flush=True)
        return 0

    def on_state(stage: str, state: str, info: dict) -> None:
        if state == JobState.RUNNING:
            run.update_stage(stage, status=StageStatus.RUNNING)
        print(f"[launch] {stage}: {state} {info.get('reason', '') or ''}".rstrip(), flush=True)

    try:
        finals = executor.follow(job_ids, on_state)
    except KeyboardInterrupt:
        executor.cancel(job_ids)
        for plan in plans:
            run.update_stage(plan.name, status=StageStatus.CANCELLED, reason="Ctrl-C: cancelled by launch")
        run.update_run(status=StageStatus.CANCELLED, ended=time.time())
        return ExitCode.CANCELLED
    final_code = 0
    for plan in plans:
        state = finals.get(plan.name, JobState.UNKNOWN)
        code = 0 if state == JobState.COMPLETED else int(executor.job_info(plan.name).get("exit_code") or 1)
        _record_stage_outcome(run, plan.name, state, code)
        if state != JobState.COMPLETED:
            run.update_stage(plan.name, reason=f"Slurm state {state}" + (f": {EXIT_REASONS[code]}" if code in EXIT_REASONS else ""))
            errors = executor.failure_lines(plan.name)   # which task, node or rank failed, from the log
            if errors:
                run.update_stage(plan.name, errors=errors)
                for line in errors:
                    print(f"[launch] {plan.name}: {line}", flush=True)
            final_code = final_code or code or 1
    run.update_run(status=StageStatus.COMPLETED if final_code == 0 else StageStatus.FAILED, ended=time.time(),
                   exit_code=final_code)
    _print_summary(run)
    return final_code


def _print_summary(run: RunDirectory) -> None:
    meta = run.metadata()
    print(f"[launch] run {meta['run_id']}: {meta['status']}  ({run.path})", flush=True)
    for s in STAGE_ORDER:
        st = meta["stages"].get(s, {})
        if st.get("status") == StageStatus.DISABLED and not st.get("reason"):
            continue
        extra = f" - {st['reason']}" if st.get("reason") else ""
        dur = f" {st['duration_s']:.1f}s" if "duration_s" in st else ""
        print(f"[launch]   {s:<11} {st.get('status', '?'):<10}{dur}{extra}", flush=True)
    results = read_json(run.layout.mmlu_results)
    if results:
        print(f"[launch]   mmlu accuracy {results.get('accuracy')} (n={results.get('n')}, "
              f"bound {results.get('lower_bound')}, pass={results.get('pass')})", flush=True)


def _dims_if_valid(cfg: DictConfig, stage: str):
    try:
        return stage_dims(cfg, stage)
    except ValueError:
        return None


def describe_plan(cfg: DictConfig, run_dir: str = "<run_dir>") -> dict:
    """Machine-readable plan for `--dry-run --json`."""
    stages = []
    for s in STAGE_ORDER:
        st = cfg.stages[s]
        dims = stage_dims(cfg, s) if st.enabled else _dims_if_valid(cfg, s)   # a disabled stage's may be unset
        entry = {"name": s, "enabled": bool(st.enabled), **(dims.describe() if dims else {})}
        if s == StageName.MMLU and dims:
            entry["shard_mode"] = st.shard_mode
            entry["shard_group"] = ("edp" if (st.shard_mode == "lockstep" and dims.ep > 1) else "dp")
        if not st.enabled and st.get("disabled_reason"):
            entry["disabled_reason"] = st.disabled_reason
        stages.append(entry)
    return {"job_name": cfg.job_name, "executor": cfg.executor.kind, "recipe": cfg.recipe.name,
            "model": cfg.model.name, "stages": stages}


def format_json(data: dict) -> str:
    return json.dumps(data, indent=2)
