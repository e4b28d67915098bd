"""run_on_ranks on the session's rank pool (PTQ_RANK_POOL=1) and on fresh processes otherwise:
which way a call goes, what a pooled job's environment is, and that a failure reads the same
either way (launcher_testing.ranks, launcher_testing.rank_pool).

The workers here import nothing themselves, so ``preloaded`` (megatron.core already imported when
the job starts) tells a pooled rank from a fresh one."""
from __future__ import annotations

import os
import sys
import time

import pytest

from launcher_testing import rank_pool, ranks
from launcher_testing.ranks import POOL_ENV, RanksFailed, run_on_ranks

pytestmark = [pytest.mark.torch, pytest.mark.timeout(900)]

WHOAMI = "test_ranks_pooled:whoami_worker"
START_S = 600    # a job's timeout includes starting the pool: 4 ranks importing torch, Megatron, ModelOpt


def whoami_worker(tag: str) -> dict:
    return {"tag": tag, "rank": int(os.environ["RANK"]), "world": int(os.environ["WORLD_SIZE"]),
            "pid": os.getpid(), "preloaded": "megatron.core" in sys.modules,
            "probe": os.environ.get("PTQ_POOL_PROBE"), "pytest_version": os.environ.get("PYTEST_VERSION"),
            "current_test": os.environ.get("PYTEST_CURRENT_TEST"), "omp": os.environ.get("OMP_NUM_THREADS")}


def exit_worker(codes: list, marks: str) -> None:
    """Rank r returns (0), exits with codes[r] once the returning ranks have returned, or hangs
    until killed (None)."""
    rank = int(os.environ["RANK"])
    if codes[rank] is None:
        print(f"rank {rank} hangs", flush=True)
        time.sleep(600)
    if codes[rank] == 0:
        open(os.path.join(marks, f"returned{rank}"), "w").close()
        return
    while not all(os.path.exists(os.path.join(marks, f"returned{r}")) for r, c in enumerate(codes) if c == 0):
        time.sleep(0.05)
    print(f"rank {rank} exits {codes[rank]}", flush=True)
    sys.exit(codes[rank])


def test_calls_run_on_the_same_pooled_workers(monkeypatch):
    monkeypatch.setenv(POOL_ENV, "1")
    pool = ranks.session_pool()
    before = pool.jobs_run
    monkeypatch.setenv("PTQ_POOL_PROBE", "set after the pool was made")
    assert ranks.fresh_reason(WHOAMI, 2) is None
    first = run_on_ranks(WHOAMI, nprocs=2, kwargs={"tag": "a"}, timeout_s=START_S)
    second = run_on_ranks(WHOAMI, nprocs=3, kwargs={"tag": "b"}, timeout_s=START_S)
    assert ranks.session_pool() is pool and pool.jobs_run == before + 2
    pids = [p.pid for p in pool.procs]
    assert len(pids) == ranks.POOL_SIZE == 4
    assert [r["pid"] for r in first] == pids[:2] and [r["pid"] for r in second] == pids[:3]
    assert [(r["tag"], r["rank"], r["world"]) for r in first + second] == [
        ("a", 0, 2), ("a", 1, 2), ("b", 0, 3), ("b", 1, 3), ("b", 2, 3)]
    assert [r["preloaded"] for r in first + second] == [True] * 5
    # what a fresh rank started now would see: this process's environment as it is now
    assert {r["probe"] for r in first + second} == {"set after the pool was made"}
    assert {r["current_test"] for r in first + second} == {os.environ["PYTEST_CURRENT_TEST"]}
    assert {r["omp"] for r in first + second} == {"1"}


def test_a_pooled_job_gets_its_env_and_loses_what_was_removed(monkeypatch):
    monkeypatch.setenv(POOL_ENV, "1")
    pool = ranks.session_pool()
    assert pool.env["PYTEST_VERSION"] == os.environ["PYTEST_VERSION"]     # in the pool's start environment
    monkeypatch.delenv("PYTEST_VERSION")
    [with_probe] = run_on_ranks(WHOAMI, nprocs=1, kwargs={"tag": "c"}, env={"PTQ_POOL_PROBE": "this job's"},
                                timeout_s=START_S)
    [after] = run_on_ranks(WHOAMI, nprocs=1, kwargs={"tag": "d"}, timeout_s=START_S)
    assert with_probe["pid"] == after["pid"] == pool.procs[0].pid
    assert (with_probe["probe"], after["probe"]) == ("this job's", None)    # a job's env= is its own
    assert (with_probe["pytest_version"], after["pytest_version"]) == (None, None)
    assert ranks.env_changes(ranks.rank_base_env())["PYTEST_VERSION"] is None


@pytest.mark.parametrize("case", ["pool off", "FRESH_RANKS", "import-time env", "more ranks than the pool"])
def test_fresh_processes_when_the_pool_cannot_run_the_call(case, monkeypatch):
    monkeypatch.setenv(POOL_ENV, "0" if case == "pool off" else "1")
    nprocs, env = 2, None
    if case == "FRESH_RANKS":
        monkeypatch.setattr(sys.modules[__name__], "FRESH_RANKS", True, raising=False)
    elif case == "import-time env":
        env = {"OMP_NUM_THREADS": "2"}
    elif case == "more ranks than the pool":
        nprocs = 5
    expected = {"pool off": "PTQ_RANK_POOL is not 1",
                "FRESH_RANKS": "test_ranks_pooled sets FRESH_RANKS = True",
                "import-time env": "OMP_NUM_THREADS must be set when a rank starts (the pool's workers have other values)",
                "more ranks than the pool": "nprocs=5 is more than the pool's 4 ranks"}[case]
    assert ranks.fresh_reason(WHOAMI, nprocs, env) == expected
    pool = ranks.session_pool()
    before, pool_pids = pool.jobs_run, {p.pid for p in pool.procs}
    results = run_on_ranks(WHOAMI, nprocs=nprocs, kwargs={"tag": case}, env=env, timeout_s=300)
    assert pool.jobs_run == before
    assert [(r["rank"], r["world"], r["preloaded"]) for r in results] == [(r, nprocs, False) for r in range(nprocs)]
    assert not {r["pid"] for r in results} & pool_pids
    assert {r["omp"] for r in results} == {"2" if case == "import-time env" else "1"}


@pytest.mark.parametrize("pool_on", ["1", "0"])
def test_a_failing_rank_raises_ranks_failed_with_every_ranks_exit_code(pool_on, monkeypatch, tmp_path):
    """Rank 0 returns, then rank 1 exits 4, rank 2 hangs and is killed after the grace: the same
    RanksFailed pooled or fresh.  (Last here: a failed pooled job kills the pool.)"""
    monkeypatch.setenv(POOL_ENV, pool_on)
    monkeypatch.setattr(rank_pool, "FAIL_GRACE_S", 10.0)
    pool = ranks.session_pool()
    before = pool.jobs_run
    with pytest.raises(RanksFailed) as e:
        run_on_ranks("test_ranks_pooled:exit_worker", nprocs=3, kwargs={"codes": [0, 4, None], "marks": str(tmp_path)},
                     timeout_s=START_S)
    assert e.value.returncodes == [0, 4, -9] and e.value.timed_out is False
    assert str(e.value).startswith("test_ranks_pooled:exit_worker on 3 ranks: exit codes [0, 4, -9]\n"
                                   "----- rank 0 (exit 0) -----\n"), str(e.value)
    assert ["rank 1 exits 4" in out for out in e.value.outputs] == [False, True, False]
    assert ["rank 2 hangs" in out for out in e.value.outputs] == [False, False, True]
    assert pool.jobs_run == before + (pool_on == "1")
    if pool_on == "1":
        assert pool.procs == []      # killed: the next pooled call starts a new pool
