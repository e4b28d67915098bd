"""SlurmExecutor against a real single-node Slurm cluster (tests/slurm_cluster.py starts it).

Stand-in stages are tiny ``python -c`` commands; the tiny pipeline end to end goes through
``slurm_cluster.run_plans`` with the pipeline's own plans.  The TIMEOUT job (1-minute limit) is
submitted when the module starts and checked by the last test, so its minute overlaps the others
and the session's single-node tiny run (slurm_runs.tiny_single_node_started), started with it.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from omegaconf import OmegaConf

try:  # tests/ on sys.path (pytest's default rootdir-relative import) or tests as a package
    from slurm_cluster import slurm_cluster  # noqa: F401
    from slurm_runs import tiny_single_node_started  # noqa: F401
except ImportError:  # pragma: no cover
    from tests.slurm_cluster import slurm_cluster  # noqa: F401
    from tests.slurm_runs import tiny_single_node_started  # noqa: F401

from launcher.schema import SlurmExecutorConfig
from launcher.executors.base import StagePlan
from launcher.executors.slurm import SlurmError, SlurmExecutor

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(240)]
PY = sys.executable

RANK_SCRIPT = r"""
import json, os
keys = ["SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_JOB_NODELIST", "SLURMD_NODENAME",
        "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS", "STAGE_FLAVOUR", "HF_TOKEN"]
env = {k: os.environ.get(k) for k in keys}
out = os.path.join(os.environ["OUT_DIR"], "rank-%s.json" % env["SLURM_PROCID"])
json.dump(env, open(out, "w"))
print("rank %s of %s ready" % (env["SLURM_PROCID"], env["SLURM_NTASKS"]), flush=True)
"""


def plan(run_dir, name, code, world=1, env=None, allow_to_fail=False):
    return StagePlan(name=name, world_size=world, argv=[PY, "-c", code], env=dict(env or {}),
                     log_path=os.path.join(run_dir, name, "log.txt"), allow_to_fail=allow_to_fail)


def touch(path):
    return f"open({path!r}, 'w').write('ran')"


def run(cluster, plans, run_dir, **kw):
    lines = []
    final, events = cluster.run_plans(plans, run_dir, echo=lines.append, **kw)
    return final, events, lines


def last_info(events, stage):
    return [i for s, _, i in events if s == stage][-1]


@pytest.fixture(scope="module")
def timeout_job(slurm_cluster, tiny_single_node_started, tmp_path_factory):
    """A stage with a 1-minute limit that sleeps for 5: submitted first, checked last.  While Slurm's
    limit runs out, the session's single-node tiny run works in the background
    (``tiny_single_node_started``: test_slurm_pipeline.py and test_slurm_multinode.py read it)."""
    run_dir = str(tmp_path_factory.mktemp("timeout") / "job" / "run")
    ex = SlurmExecutor(slurm_cluster.executor_config(time="1"), run_dir, echo=lambda line: None)
    ids = ex.submit([plan(run_dir, "quantize", "import time; print('sleeping', flush=True); time.sleep(300)")])
    yield ex, ids, time.monotonic()
    ex.cancel(ids)


def test_four_ranks_env_and_logs(slurm_cluster, timeout_job, tmp_path):
    run_dir = str(tmp_path / "my job" / "run")      # a space in the path: quoting in #SBATCH and srun
    out = tmp_path / "ranks"
    out.mkdir()
    p = plan(run_dir, "quantize", RANK_SCRIPT, world=4,
             env={"OUT_DIR": str(out), "STAGE_FLAVOUR": "a b'c", "HF_TOKEN": "hf_secret_value"})
    t0 = time.monotonic()
    final, events, lines = run(slurm_cluster, [p], run_dir)
    assert final == {"quantize": "COMPLETED"}, events
    ranks = {int(f.name[5:-5]): json.loads(f.read_text()) for f in out.glob("rank-*.json")}
    assert sorted(ranks) == [0, 1, 2, 3]
    for r, env in ranks.items():
        assert env["SLURM_NTASKS"] == "4" and env["SLURM_LOCALID"] == str(r)
        assert env["MASTER_ADDR"] == "localhost" == env["SLURMD_NODENAME"]   # node name, not the VM's
        assert env["MASTER_PORT"] == ranks[0]["MASTER_PORT"] and env["MASTER_PORT"].isdigit()
        assert env["STAGE_FLAVOUR"] == "a b'c" and env["OMP_NUM_THREADS"] == "1"
        assert env["HF_TOKEN"] == "hf_secret_value"          # reaches the ranks ...
    script = open(os.path.join(run_dir, "slurm", "quantize.sbatch")).read()
    assert "hf_secret_value" not in script                   # ... without being written to disk
    states = [st for s, st, _ in events]
    assert states[0] in ("PENDING", "RUNNING") and states[-1] == "COMPLETED"
    log = open(p.log_path).read()
    assert "[slurm] stage quantize job" in log and log.count("ready") == 4
    assert sum("ready" in line for line in lines) == 4       # tailed to the console
    record = json.load(open(os.path.join(run_dir, "slurm", "jobs.json")))
    assert record["stages"]["quantize"]["final_state"] == "COMPLETED"
    assert record["stages"]["quantize"]["script"].endswith("slurm/quantize.sbatch")
    assert SlurmExecutor.status(run_dir) == {"quantize": "COMPLETED"}
    info = SlurmExecutor(slurm_cluster.executor_config(), run_dir).job_info("quantize")  # a fresh process's view
    assert info["state"] == "COMPLETED" and info["exit_code"] == 0 and info["node_list"] == "localhost"
    print(f"4-rank stage: {time.monotonic() - t0:.1f} s")


def test_failing_stage_stops_dependants(slurm_cluster, tmp_path):
    run_dir = str(tmp_path / "job" / "run")
    plans = [plan(run_dir, "quantize", "print('ok')"),
             plan(run_dir, "mmlu", "import sys; print('gate failed'); sys.exit(3)", world=2),
             plan(run_dir, "export", touch(str(tmp_path / "export-ran"))),
             plan(run_dir, "vllm_smoke", touch(str(tmp_path / "smoke-ran")))]
    final, events, _ = run(slurm_cluster, plans, run_dir)
    assert final == {"quantize": "COMPLETED", "mmlu": "FAILED", "export": "CANCELLED", "vllm_smoke": "CANCELLED"}
    assert last_info(events, "mmlu")["exit_code"] == 3
    for s in ("export", "vllm_smoke"):
        info = last_info(events, s)
        assert info["reason"] == "DependencyNeverSatisfied", info
        assert info["run_time"] in (None, "00:00:00") and info["node_list"] is None, info   # never ran
    assert not (tmp_path / "export-ran").exists() and not (tmp_path / "smoke-ran").exists()
    assert not os.path.exists(plans[2].log_path) or "[slurm] stage" not in open(plans[2].log_path).read()
    ids = [e["job_id"] for e in json.load(open(os.path.join(run_dir, "slurm", "jobs.json")))["stages"].values()]
    assert not set(ids) & set(slurm_cluster.active_jobs())   # nothing lingers in the queue
    assert SlurmExecutor.status(run_dir) == final
    # what `launch` prints under a failed stage: srun's line naming the tasks and their node
    lines = SlurmExecutor(slurm_cluster.executor_config(), run_dir).failure_lines("mmlu")
    assert lines == ["srun: error: localhost: tasks 0-1: Exited with exit code 3"], lines


def test_allow_to_fail_continues(slurm_cluster, tmp_path):
    run_dir = str(tmp_path / "job" / "run")
    plans = [plan(run_dir, "quantize", "print('ok')"),
             plan(run_dir, "mmlu", "import sys; sys.exit(3)", allow_to_fail=True),
             plan(run_dir, "export", touch(str(tmp_path / "export-ran")))]
    final, events, _ = run(slurm_cluster, plans, run_dir)
    assert final == {"quantize": "COMPLETED", "mmlu": "FAILED", "export": "COMPLETED"}
    assert (tmp_path / "export-ran").exists()
    record = json.load(open(os.path.join(run_dir, "slurm", "jobs.json")))
    q, m = record["stages"]["quantize"]["job_id"], record["stages"]["mmlu"]["job_id"]
    assert record["stages"]["export"]["dependency"] == f"afterany:{m},afterok:{q}"


def test_allow_to_fail_does_not_skip_a_failed_upstream(slurm_cluster, tmp_path):
    """quantize fails -> mmlu (may fail) never runs -> export must not run either (afterany alone would)."""
    run_dir = str(tmp_path / "job" / "run")
    plans = [plan(run_dir, "quantize", "import sys; sys.exit(1)"),
             plan(run_dir, "mmlu", touch(str(tmp_path / "mmlu-ran")), allow_to_fail=True),
             plan(run_dir, "export", touch(str(tmp_path / "export-ran")))]
    final, _, _ = run(slurm_cluster, plans, run_dir)
    assert final == {"quantize": "FAILED", "mmlu": "CANCELLED", "export": "CANCELLED"}
    assert not (tmp_path / "mmlu-ran").exists() and not (tmp_path / "export-ran").exists()


def test_cancel_from_outside_is_reported(slurm_cluster, tmp_path):
    run_dir = str(tmp_path / "job" / "run")
    plans = [plan(run_dir, "quantize", "import time; print('started', flush=True); time.sleep(300)"),
             plan(run_dir, "mmlu", touch(str(tmp_path / "mmlu-ran")))]
    cancelled = []

    def on_state(stage, state, info):
        if stage == "quantize" and state == "RUNNING" and not cancelled:
            # someone else (an operator, a preemption script) cancels it - not the executor
            subprocess.run(["scancel", info["job_id"]], check=True, env=slurm_cluster.env)
            cancelled.append(time.monotonic())

    ex = SlurmExecutor(slurm_cluster.executor_config(), run_dir, echo=lambda line: None)
    ids = ex.submit(plans)
    final = ex.follow(ids, on_state, timeout_s=90)
    assert cancelled and final == {"quantize": "CANCELLED", "mmlu": "CANCELLED"}
    assert time.monotonic() - cancelled[0] < 60          # no hang (submitit+sacct would wait forever)
    assert not (tmp_path / "mmlu-ran").exists()


def test_cancel_by_launcher(slurm_cluster, tmp_path):
    """What Ctrl-C in `launch` does: cancel everything it submitted, running or pending."""
    run_dir = str(tmp_path / "job" / "run")
    plans = [plan(run_dir, "quantize", "import time; time.sleep(300)"),
             plan(run_dir, "mmlu", "print('never')", allow_to_fail=True),
             plan(run_dir, "export", "print('never')")]
    ex = SlurmExecutor(slurm_cluster.executor_config(), run_dir, echo=lambda line: None)
    ids = ex.submit(plans)
    ex.cancel(ids)
    final = ex.follow(ids, timeout_s=60)
    assert final == {"quantize": "CANCELLED", "mmlu": "CANCELLED", "export": "CANCELLED"}


def test_sbatch_rejection_cancels_earlier_stages(slurm_cluster, tmp_path):
    run_dir = str(tmp_path / "job" / "run")
    plans = [plan(run_dir, "quantize", "import time; time.sleep(300)"),
             # a script over slurmctld's max_script_size (4 MB): sbatch refuses it
             plan(run_dir, "mmlu", "print('x')  # " + "x" * 5_000_000)]
    ex = SlurmExecutor(slurm_cluster.executor_config(), run_dir, echo=lambda line: None)
    with pytest.raises(SlurmError, match=r"sbatch failed for stage mmlu \(exit 1\): .*too long(.|\n)*cancelled the stages submitted before it"):
        ex.submit(plans)
    qid = json.load(open(os.path.join(run_dir, "slurm", "jobs.json")))["stages"]["quantize"]["job_id"]
    assert ex.follow([qid], timeout_s=60) == {"quantize": "CANCELLED"}


def test_timeout_is_reported(slurm_cluster, timeout_job):
    ex, ids, t0 = timeout_job
    events = []
    final = ex.follow(ids, lambda s, st, i: events.append((st, i)), timeout_s=150)
    assert final == {"quantize": "TIMEOUT"}, events
    print(f"TIMEOUT reported {time.monotonic() - t0:.0f} s after submission (limit 60 s)")


def test_missing_sbatch_says_what_to_do(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))               # no Slurm client on PATH
    ex = SlurmExecutor(OmegaConf.structured(SlurmExecutorConfig(poll_interval_s=1)), str(tmp_path / "run"))
    with pytest.raises(SlurmError, match=r"`sbatch` not found .*slurm-client.*executor=local"):
        ex.submit([plan(str(tmp_path / "run"), "quantize", "print(1)")])


def test_status_without_slurm_reports_recorded_states(tmp_path, monkeypatch):
    """`launch status` on a machine without Slurm (or with the controller down): recorded states."""
    slurm_dir = tmp_path / "run" / "slurm"
    slurm_dir.mkdir(parents=True)
    (slurm_dir / "jobs.json").write_text(json.dumps({"order": ["quantize", "mmlu"], "stages": {
        "quantize": {"job_id": "7", "final_state": "COMPLETED",
                     "final_info": {"job_id": "7", "state": "COMPLETED", "exit_code": 0}},
        "mmlu": {"job_id": "8", "final_state": None}}}))
    monkeypatch.setenv("PATH", str(tmp_path))
    details = SlurmExecutor.status_details(str(tmp_path / "run"))
    assert {s: d["state"] for s, d in details.items()} == {"quantize": "COMPLETED", "mmlu": "UNKNOWN"}
    assert "Slurm not reachable" in details["mmlu"]["reason"]
