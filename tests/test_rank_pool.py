"""launcher_testing.rank_pool: jobs on preloaded gloo ranks see what a fresh rank would see, and a
failed or hung job costs one pool, never a later job's result.

The pools here preload torch only (a few seconds to start); the suite's pool preloads Megatron-Core
and ModelOpt as well (launcher_testing.rank_pool.PRELOAD)."""
from __future__ import annotations

import os
import sys

import pytest

from conftest import ROOT

pytestmark = [pytest.mark.torch, pytest.mark.timeout(300)]


def state_worker(tag: str, apply_patch: bool = False, exit_code: int = 0) -> dict:
    """Report what this rank sees, then leave as much process state behind as a job could."""
    import signal

    import torch
    import torch.distributed as dist
    from launcher.megatron import patches

    seen = {"tag": tag, "rank": int(os.environ["RANK"]), "world": int(os.environ["WORLD_SIZE"]),
            "port": os.environ["MASTER_PORT"], "pid": os.getpid(), "initialized_before": dist.is_initialized(),
            "patches_before": patches.applied(), "recorded_before": patches.applied_in_process(),
            "leftover_env": os.environ.get("LEFTOVER"),
            "threads": torch.get_num_threads(), "randn": torch.randn(3).tolist(),
            "sigterm_default": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL, "cwd": os.getcwd()}
    dist.init_process_group("gloo", init_method="env://")
    x = torch.tensor([float(seen["rank"] + 1)])
    dist.all_reduce(x)
    seen["sum"] = x.item()
    if exit_code:
        print(f"rank {seen['rank']} exits {exit_code}", flush=True)
        sys.exit(exit_code)
    if apply_patch:
        patches.apply("cpu_streams")
    os.environ["LEFTOVER"] = "yes"               # what the next job must not see
    torch.set_num_threads(2)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.chdir("/")
    return seen                                  # the process group is left initialized


def hang_worker() -> None:
    import time

    print("hanging", flush=True)
    time.sleep(600)


def child_then_fail_worker(pid_dir: str) -> None:
    """Leave a multiprocessing child running (as dist_checkpointing's writers do), then fail."""
    import multiprocessing
    import time

    child = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(600,))
    child.start()
    with open(os.path.join(pid_dir, f"{os.environ['RANK']}.pid"), "w") as f:
        f.write(str(child.pid))
    sys.exit(3)


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's reaper may be slow)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def one_rank_fails_worker() -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="env://")
    if int(os.environ["RANK"]) == 1:
        raise RuntimeError("rank 1 broke")
    dist.all_reduce(torch.ones(1))               # rank 0 waits for rank 1 here


@pytest.fixture
def pool():
    from launcher_testing.rank_pool import RankPool
    from launcher_testing.ranks import free_port

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]),
           "CUDA_VISIBLE_DEVICES": ""}
    p = RankPool(2, env=env, cwd=ROOT, free_port=free_port, preload=())
    yield p
    p.close()


def test_each_job_starts_from_a_fresh_ranks_state(pool):
    first = pool.run("test_rank_pool:state_worker", 2, {"tag": "a", "apply_patch": True}, timeout_s=120)
    second = pool.run("test_rank_pool:state_worker", 2, {"tag": "b"}, timeout_s=120)
    single = pool.run("test_rank_pool:state_worker", 1, {"tag": "c"}, timeout_s=120)
    assert pool.starts == 1 and pool.jobs_run == 3
    assert [s["pid"] for s in second] == [s["pid"] for s in first]          # the same processes ...
    for job, world in ((first, 2), (second, 2), (single, 1)):
        assert [s["rank"] for s in job] == list(range(world)) and {s["world"] for s in job} == {world}
        assert {s["sum"] for s in job} == {world * (world + 1) / 2}          # a working gloo group each time
        for s in job:                                                         # ... in a fresh rank's state
            assert s["initialized_before"] is False and s["patches_before"] == s["recorded_before"] == []
            assert s["leftover_env"] is None and s["threads"] == 1 and s["sigterm_default"]
            assert s["cwd"] == ROOT
    assert first[0]["port"] != second[0]["port"]
    # the default generator as a fresh process has it: the same draws in every job
    assert first[0]["randn"] == second[0]["randn"] == single[0]["randn"]


def test_a_failed_job_reports_exit_codes_and_replaces_the_pool(pool):
    from launcher_testing.rank_pool import JobFailure

    with pytest.raises(JobFailure) as e:
        pool.run("test_rank_pool:state_worker", 2, {"tag": "x", "exit_code": 3}, timeout_s=120)
    assert e.value.returncodes == [3, 3] and not e.value.timed_out
    assert [("rank %d exits 3" % r) in out for r, out in enumerate(e.value.outputs)] == [True, True]
    assert pool.procs == []                                                  # killed, not reused
    after = pool.run("test_rank_pool:state_worker", 2, {"tag": "y"}, timeout_s=120)
    assert pool.starts == 2 and [s["initialized_before"] for s in after] == [False, False]


def test_a_failed_jobs_children_end_with_its_workers(pool, tmp_path):
    """A worker that failed has already exited when the pool is killed; what it started must not run on."""
    import time

    from launcher_testing.rank_pool import JobFailure

    with pytest.raises(JobFailure) as e:
        pool.run("test_rank_pool:child_then_fail_worker", 2, {"pid_dir": str(tmp_path)}, timeout_s=120)
    assert e.value.returncodes == [3, 3]
    pids = [int((tmp_path / f"{rank}.pid").read_text()) for rank in range(2)]
    deadline = time.monotonic() + 10
    while any(_running(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [_running(pid) for pid in pids] == [False, False], pids


def test_one_rank_failing_stops_the_ranks_waiting_for_it(pool, monkeypatch):
    from launcher_testing import rank_pool

    monkeypatch.setattr(rank_pool, "FAIL_GRACE_S", 2.0)
    with pytest.raises(rank_pool.JobFailure) as e:
        pool.run("test_rank_pool:one_rank_fails_worker", 2, timeout_s=120)
    assert e.value.returncodes[1] == 1 and e.value.returncodes[0] != 0      # rank 0 killed (or failed) after the grace
    assert "RuntimeError: rank 1 broke" in e.value.outputs[1]


def test_a_hung_job_times_out_and_the_next_job_runs(pool):
    from launcher_testing.rank_pool import JobFailure

    pool.run("test_rank_pool:state_worker", 2, {"tag": "v"}, timeout_s=120)   # started: the 5 s are the job's own
    with pytest.raises(JobFailure) as e:
        pool.run("test_rank_pool:hang_worker", 2, timeout_s=5)
    assert e.value.timed_out and "hanging" in e.value.outputs[0]
    assert [s["sum"] for s in pool.run("test_rank_pool:state_worker", 2, {"tag": "z"}, timeout_s=120)] == [3.0, 3.0]
    with pytest.raises(ValueError, match="nprocs=3 does not fit a pool of 2 ranks"):
        pool.run("test_rank_pool:state_worker", 3, {"tag": "w"})
