"""The tiny pipeline end to end through a real Slurm cluster: one sbatch job per stage, 4 srun tasks.

quantize (EP4) -> mmlu (EP4) -> export (PP4) -> vllm_smoke (skip: NVFP4 on CPU), chained with
afterok; `launch` follows the jobs and exits with the pipeline's status; `launch status` reads
each stage's state back from Slurm.  The run itself is ``slurm_runs.tiny_single_node_run`` (one per
session: the two-node test compares its outputs with this one's).
"""
import json
from pathlib import Path

import pytest

try:
    from slurm_cluster import slurm_cluster  # noqa: F401
    from slurm_runs import tiny_single_node_run  # noqa: F401
except ImportError:  # pragma: no cover
    from tests.slurm_cluster import slurm_cluster  # noqa: F401
    from tests.slurm_runs import tiny_single_node_run  # noqa: F401

from launcher.cli import main

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.timeout(1500)]


def test_tiny_pipeline_through_slurm(slurm_cluster, tiny_single_node_run, capsys):
    run = tiny_single_node_run
    assert run.rc == 0, run.output[-4000:] + slurm_cluster.logs_tail()
    run_dir = Path(run.run_dir)
    meta = json.loads((run_dir / "metadata.json").read_text())
    assert meta["executor"] == "slurm"
    assert [meta["stages"][s]["status"] for s in ("quantize", "mmlu", "export", "vllm_smoke")] == [
        "completed", "completed", "completed", "skipped"], meta
    jobs = json.loads((run_dir / "slurm" / "jobs.json").read_text())["stages"]
    assert len({j["job_id"] for j in jobs.values()}) == 4
    assert "--ntasks=4" in (run_dir / "slurm" / "quantize.sbatch").read_text()
    results = json.loads((run_dir / "mmlu" / "results.json").read_text())
    assert results["pass"] is True
    assert json.loads((run_dir / "export" / "verify.json").read_text())["ok"] is True
    assert main(["status", str(run_dir)]) == 0
    status = capsys.readouterr().out
    # one line per stage: "  <stage> <state> job <id>[ - reason]"; the state is Slurm's (the
    # vllm_smoke job completed: its skip is the stage's own decision, recorded in metadata.json)
    states = {line.split()[0]: line.split()[1] for line in status.splitlines()[1:] if line.startswith("  ")}
    assert states == {"quantize": "COMPLETED", "mmlu": "COMPLETED", "export": "COMPLETED",
                      "vllm_smoke": "COMPLETED"}, status
    assert slurm_cluster.active_jobs() == []
