"""Ordered stages over one run directory: plan, run, resume, stop on failure (no torch).

quantize -> mmlu -> export -> vllm_smoke.  A failed stage (a gate below its bound included)
stops the pipeline unless `allow_to_fail`; `--resume RUN_DIR` skips stages whose manifest
matches the current config and reruns the rest (and everything after the first rerun).  A stage
whose job ended otherwise than COMPLETED after its manifest was written (NODE_FAIL once the
outputs were published) keeps its outputs and its status; `--resume` re-verifies the outputs
against the manifest and skips the stage only if they verify.
"""
from __future__ import annotations

import errno
import json
import os
import shutil
import sys
import time
from typing import Optional

from omegaconf import DictConfig

from launcher.contract import (
    EXIT_REASONS, STAGE_ORDER, ExitCode, JobState, RunLayout, StageName, StageStatus, split_secrets)
from launcher.executors.base import Executor, StagePlan
from launcher.rundir import RunDirectory
from launcher.schema import enabled_stages
from launcher.stages import registry
from launcher.topology import ParallelDims

QUIET_WARNINGS = "ignore::FutureWarning,ignore::DeprecationWarning,ignore::UserWarning"


def stage_plan(cfg: DictConfig, stage: str, run_dir: str, python: Optional[str] = None,
               preflight_only: bool = False) -> StagePlan:
    dims = ParallelDims.from_stage(cfg, stage)
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


def make_executor(cfg: DictConfig, run_dir: str) -> Executor:
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
            reason = _skip_reason_on_resume(run, s)
            if reason:
                run.update_stage(s, status=StageStatus.SKIPPED, reason=reason)
                print(f"[launch] {s}: skipped ({reason})", flush=True)
                continue
        rerun = True
        out.append(s)
    return out


def forget_manifests(run: RunDirectory, stages: list[str]) -> None:
    """Stages about to run lose their manifest first: a manifest in the run directory then always
    describes the latest attempt, and one present after a job that did not complete was written
    by that job (the worker's rank 0 removes it too, before the work)."""
    for s in stages:
        try:
            os.remove(run.layout.manifest(s))
        except FileNotFoundError:
            pass


# the job states after which a matching manifest is trusted as it is; after any other (NODE_FAIL,
# TIMEOUT, CANCELLED, FAILED, or a launch that never saw the end) the outputs are re-verified first
_TRUSTED = (StageStatus.COMPLETED, StageStatus.SKIPPED)


def _skip_reason_on_resume(run: RunDirectory, stage: str) -> Optional[str]:
    """Why a stage whose manifest matches may be skipped, or None (then it is redone).

    The manifest is the stage's own claim that its work completed (rank 0 writes it after every
    rank finished); the recorded status is the executor's word on the job.  When the job did not
    end COMPLETED although the manifest was written (Slurm declared NODE_FAIL once the outputs
    were published), the outputs are re-verified against the manifest (every file, size and sha256):
    verified -> skipped; otherwise they are set aside as <entry>.stale and the stage is redone."""
    status = run.metadata()["stages"].get(stage, {}).get("status")
    if status in _TRUSTED:
        return "resume: manifest matches the config"
    problems = run.verify_outputs(stage)
    if not problems:
        n = len(run.manifest(stage).get("outputs") or {})
        return f"resume: outputs re-verified against the manifest ({n} files; the stage's job had ended {status})"
    print(f"[launch] {stage}: outputs do not match the manifest (the stage's job had ended {status}): "
          + "; ".join(problems[:5]) + (f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""), flush=True)
    moved = run.set_aside_outputs(stage)
    if moved:
        print(f"[launch] {stage}: set aside {', '.join(os.path.basename(m) for m in moved)}; redoing the stage",
              flush=True)
    run.update_stage(stage, reverify_problems=problems[:20])
    return None


def _record_stage_outcome(run: RunDirectory, stage: str, state: str, exit_code: int) -> str:
    """metadata.json for a finished stage; returns its status word."""
    skip_reason = registry.get(stage).skip_reason(run.layout)
    if state == JobState.COMPLETED and skip_reason is not None:
        run.update_stage(stage, status=StageStatus.SKIPPED, reason=skip_reason, exit_code=exit_code)
        print(f"[launch] {stage}: SKIPPED - {skip_reason}", flush=True)
        return StageStatus.SKIPPED
    status = {JobState.COMPLETED: StageStatus.COMPLETED, JobState.FAILED: StageStatus.FAILED,
              JobState.CANCELLED: StageStatus.CANCELLED}.get(state, state.lower())
    fields = {"status": status, "exit_code": exit_code, "state": state}
    if state != JobState.COMPLETED:
        fields["reason"] = EXIT_REASONS.get(exit_code, f"exit code {exit_code}")
        if run.manifest(stage):   # removed before the stage was submitted: written by this job
            # the work completed and rank 0 wrote the manifest before the job ended this way: the
            # outputs are kept, the status stays the executor's word, --resume re-verifies them
            fields["outputs"] = "complete (manifest written); --resume re-verifies them against the manifest"
            print(f"[launch] {stage}: {state} after the stage's work had completed: outputs kept "
                  f"(manifest written); --resume re-verifies them", flush=True)
    run.update_stage(stage, **fields)
    return status


def run_pipeline(cfg: DictConfig, run: RunDirectory, resume: bool = False, preflight_only: bool = False,
                 detach: bool = False) -> int:
    """Run every enabled stage; returns the process exit code for `launch`."""
    _export_secrets(cfg)
    todo = enabled_stages(cfg) if preflight_only else stages_to_run(cfg, run, resume)
    if not preflight_only:
        forget_manifests(run, todo)
    plans = build_plans(cfg, run.path, preflight_only=preflight_only, stages=todo)
    run.update_run(status=StageStatus.RUNNING, started=time.time())
    return drive(make_executor(cfg, run.path), run, plans, preflight_only, detach)


def drive(executor: Executor, run: RunDirectory, plans: list[StagePlan], preflight_only: bool = False,
          detach: bool = False) -> int:
    """The one loop for every executor: record each stage's result as it comes, stop after a
    failure (unless allow_to_fail or the executor stops later stages itself), Ctrl-C cancels."""
    def progress(stage: str, message: str, **fields) -> None:
        if fields:
            run.update_stage(stage, **fields)
        print(f"[launch] {stage}: {message}", flush=True)

    final_code, done, recording = 0, 0, None
    try:
        for result in executor.run(plans, progress, preflight_only=preflight_only, detach=detach):
            plan = plans[done]
            assert result.name == plan.name, (result.name, plan.name)
            done += 1
            recording = plan.name
            status = _record_stage_outcome(run, plan.name, result.state, result.exit_code)
            recording = None
            if result.duration_s is not None:
                print(f"[launch] {plan.name}: {status} in {result.duration_s:.1f}s (exit {result.exit_code})", flush=True)
            if result.interrupted:
                _mark_not_run(run, [p.name for p in plans[done:]], "cancelled")
                run.update_run(status=StageStatus.CANCELLED, ended=time.time())
                return ExitCode.CANCELLED
            if result.state == JobState.COMPLETED:
                continue
            if result.reason:
                run.update_stage(plan.name, reason=result.reason)
            if result.errors:
                run.update_stage(plan.name, errors=result.errors)
                for line in result.errors:
                    print(f"[launch] {plan.name}: {line}", flush=True)
            code = result.exit_code or ExitCode.FAILED
            # the exit code is the first failure's where the executor chains failures (Slurm cancels
            # what follows it, so the first one is the cause); otherwise the last failed stage's
            final_code = (final_code or code) if executor.chains_failures else code
            if not plan.allow_to_fail and not executor.chains_failures:
                _mark_not_run(run, [p.name for p in plans[done:]], f"{plan.name} failed")
                break
    except OSError as e:
        if e.errno not in OUT_OF_SPACE:
            raise
        executor.cancel()
        return _out_of_space(run, recording or (plans[done].name if done < len(plans) else None), e)
    except KeyboardInterrupt:
        executor.cancel()
        for plan in plans[done:]:
            run.update_stage(plan.name, status=StageStatus.CANCELLED, reason="Ctrl-C: cancelled by launch")
        run.update_run(status=StageStatus.CANCELLED, ended=time.time())
        return ExitCode.CANCELLED
    if executor.detached:
        print(f"[launch] detached; follow with: launch status {run.path}", flush=True)
        return 0
    run.update_run(status=StageStatus.COMPLETED if final_code == 0 else StageStatus.FAILED, ended=time.time(),
                   exit_code=final_code)
    _print_summary(run)
    return final_code


OUT_OF_SPACE = (errno.ENOSPC, errno.EDQUOT)


def _out_of_space(run: RunDirectory, stage: Optional[str], error: OSError) -> int:
    """The file system holding the run directory filled up while ``stage`` ran (its log, or a file the
    launcher writes): the stage is stopped; say so with the free space and the way on, and record it
    in metadata.json if the disk still takes that."""
    free = shutil.disk_usage(run.path).free
    print(f"[launch] {stage + ': ' if stage else ''}no space left on the device: {error}", flush=True)
    print(f"[launch] {run.path}: {free / 1e9:.2f} GB free on its file system; free space there, then "
          f"`launch <config> --resume {run.path}` (completed stages are kept)", flush=True)
    try:
        if stage:
            run.update_stage(stage, status=StageStatus.FAILED, reason=f"no space left on the device: {error}")
        run.update_run(status=StageStatus.FAILED, ended=time.time(), exit_code=int(ExitCode.FAILED))
    except OSError as again:
        print(f"[launch] metadata.json could not be updated either ({again}): it may still say "
              f"{stage or 'the run'} is running", flush=True)
    return ExitCode.FAILED


def _mark_not_run(run: RunDirectory, stages: list[str], why: str) -> None:
    for s in stages:
        run.update_stage(s, status=StageStatus.NOT_RUN, reason=why)
        print(f"[launch] {s}: not run ({why})", flush=True)


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
    for s in STAGE_ORDER:
        line = registry.get(s).summary(run.layout)
        if line:
            print(f"[launch]   {line}", flush=True)


def _dims_if_valid(cfg: DictConfig, stage: str):
    try:
        return ParallelDims.from_stage(cfg, stage)
    except ValueError:
        return None


def describe_plan(cfg: DictConfig, run_dir: str = "<run_dir>") -> dict:
    """Machine-readable plan for `--dry-run --json`."""
    stages = []
    for s in STAGE_ORDER:
        st = cfg.stages[s]
        if s == StageName.VLLM_SMOKE:   # one launcher rank; vLLM starts its own tensor-parallel workers
            entry = {"name": s, "enabled": bool(st.enabled)}
            if st.enabled:
                entry.update(world_size=1, tensor_parallel_size=int(st.tensor_parallel_size))
            elif st.disabled_reason:
                entry["disabled_reason"] = st.disabled_reason
            stages.append(entry)
            continue
        dims = ParallelDims.from_stage(cfg, s) if st.enabled else _dims_if_valid(cfg, s)   # a disabled stage's may be unset
        entry = {"name": s, "enabled": bool(st.enabled), **(dims.describe() if dims else {})}
        if s == StageName.MMLU and dims:
            entry["shard_mode"] = st.shard_mode
            entry["shard_group"] = ("edp" if (st.shard_mode == "lockstep" and dims.ep > 1) else "dp")
        stages.append(entry)
    return {"job_name": cfg.job_name, "executor": cfg.executor.kind, "recipe": cfg.recipe.name,
            "model": cfg.model.name, "stages": stages}


def format_json(data: dict) -> str:
    return json.dumps(data, indent=2)
