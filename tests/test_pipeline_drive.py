"""The pipeline's one loop (``pipeline.drive``) over both real executors: the same three stand-in
stages (quantize passes, mmlu exits with the gate's code, export would pass) give each executor's
own record of what ran - the local loop stops handing out stages, Slurm's dependencies cancel them."""
from __future__ import annotations

import os
import sys

import pytest

try:  # tests/ on sys.path (pytest's default rootdir-relative import) or tests as a package
    from slurm_cluster import slurm_cluster  # noqa: F401
except ImportError:  # pragma: no cover
    from tests.slurm_cluster import slurm_cluster  # noqa: F401

from omegaconf import OmegaConf

from launcher.contract import ExitCode, StageStatus
from launcher.executors.base import StagePlan
from launcher.pipeline import drive
from launcher.rundir import RunDirectory

pytestmark = [pytest.mark.timeout(240)]


def _run(tmp_path) -> RunDirectory:
    path = tmp_path / "run"
    path.mkdir()
    run = RunDirectory(str(path))
    run.write_metadata({"run_id": "run", "status": "pending",
                        "stages": {s: {"status": "pending"} for s in ("quantize", "mmlu", "export")}})
    return run


def _plans(run: RunDirectory) -> list[StagePlan]:
    code = {"quantize": "print('q ok')", "mmlu": f"import sys; sys.exit({int(ExitCode.GATE_FAILED)})",
            "export": "print('e ok')"}
    return [StagePlan(name=s, world_size=1, argv=[sys.executable, "-c", c], log_path=run.layout.log(s))
            for s, c in code.items()]


def test_local_loop_stops_after_the_failed_stage(tmp_path, capsys):
    from launcher.executors.local import LocalExecutor

    run = _run(tmp_path)
    cfg = OmegaConf.create({"master_port": None, "omp_num_threads": 1})
    assert drive(LocalExecutor(cfg, run.path, echo=False), run, _plans(run)) == ExitCode.GATE_FAILED
    st = run.metadata()["stages"]
    assert st["quantize"]["status"] == StageStatus.COMPLETED and st["quantize"]["exit_code"] == 0
    assert (st["mmlu"]["status"], st["mmlu"]["exit_code"], st["mmlu"]["reason"]) == (
        StageStatus.FAILED, 3, "gate failed (accuracy below the bound)")
    assert (st["export"]["status"], st["export"]["reason"]) == (StageStatus.NOT_RUN, "mmlu failed")
    out = capsys.readouterr().out
    assert "[launch] mmlu: running on 1 local rank(s) -> " in out and "[launch] mmlu: failed in " in out
    assert run.metadata()["status"] == StageStatus.FAILED and run.metadata()["exit_code"] == 3


@pytest.mark.slurm
def test_slurm_loop_records_what_slurm_did(tmp_path, capsys, slurm_cluster):
    from launcher.executors.slurm import SlurmExecutor

    run = _run(tmp_path)
    ex = SlurmExecutor(slurm_cluster.executor_config(), run.path, echo=lambda line: None)
    assert drive(ex, run, _plans(run)) == ExitCode.GATE_FAILED
    st = run.metadata()["stages"]
    assert st["quantize"]["status"] == StageStatus.COMPLETED and st["quantize"]["job_id"]
    assert (st["mmlu"]["status"], st["mmlu"]["exit_code"], st["mmlu"]["reason"]) == (
        StageStatus.FAILED, 3, "Slurm state FAILED: gate failed (accuracy below the bound)")
    assert st["export"]["status"] == StageStatus.CANCELLED   # afterok never satisfied: Slurm cancelled it
    out = capsys.readouterr().out
    assert f"[launch] mmlu: submitted as Slurm job {st['mmlu']['job_id']}" in out
    assert run.metadata()["status"] == StageStatus.FAILED and run.metadata()["exit_code"] == 3
    assert slurm_cluster.active_jobs() == []


@pytest.mark.slurm
def test_slurm_detach_submits_and_returns(tmp_path, capsys, slurm_cluster):
    from launcher.executors.slurm import SlurmExecutor

    run = _run(tmp_path)
    ex = SlurmExecutor(slurm_cluster.executor_config(), run.path, echo=lambda line: None)
    plans = _plans(run)[:1]
    assert drive(ex, run, plans, detach=True) == 0
    assert ex.detached and run.metadata()["stages"]["quantize"]["status"] == StageStatus.SUBMITTED
    assert f"[launch] detached; follow with: launch status {run.path}" in capsys.readouterr().out
    assert ex.follow(ex._job_ids, timeout_s=60) == {"quantize": "COMPLETED"}
