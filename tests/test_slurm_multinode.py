"""Two Slurm nodes on one machine (tests/slurm_multinode_cluster.py: a network namespace per node):
ranks spread over nodes, a gloo group across them, the tiny pipeline at EP4 / PP4 over both
nodes, and three faults across nodes, each followed by ``launch --resume``.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from typing import Optional

import pytest

try:
    from slurm_cluster import slurm_cluster  # noqa: F401
    from slurm_multinode_cluster import slurm_multinode  # noqa: F401
    from slurm_runs import Launch, compare_outputs, read_json, tiny_single_node_run  # noqa: F401
except ImportError:  # pragma: no cover
    from tests.slurm_cluster import slurm_cluster  # noqa: F401
    from tests.slurm_multinode_cluster import slurm_multinode  # noqa: F401
    from tests.slurm_runs import Launch, compare_outputs, read_json, tiny_single_node_run  # noqa: F401

try:
    from slurm_netns import PREFIX, NetnsCluster, cleanup_stale, list_namespaces, namespace_pids, unavailable_reason
except ImportError:  # pragma: no cover
    from tests.slurm_netns import PREFIX, NetnsCluster, cleanup_stale, list_namespaces, namespace_pids, unavailable_reason

from launcher import hold
from launcher.executors.base import StagePlan
from launcher.executors.slurm import SlurmExecutor
from launcher.slurm_env import derived_port

pytestmark = [pytest.mark.slurm]
# the two-node pipeline test asks for tiny_single_node_run by getfixturevalue (slurm_runs starts it early)
USES_TINY_SINGLE_NODE_RUN = True

RANK_SCRIPT = r"""
import datetime, json, os, socket
from launcher.slurm_env import rendezvous_defaults
from launcher.megatron import dist as mdist
env = mdist.rank_env()
bare = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
rec = {"rank_env": env, "node": os.environ["SLURMD_NODENAME"], "master": os.environ["MASTER_ADDR"],
       "port": os.environ["MASTER_PORT"], "derived": rendezvous_defaults(bare),
       "hostname_resolves_to": socket.gethostbyname(socket.gethostname()),
       "gloo_ifname": mdist.choose_gloo_interface(env)}
import torch, torch.distributed as dist
dist.init_process_group("gloo", init_method="env://", rank=env["rank"], world_size=env["world_size"],
                        timeout=datetime.timedelta(seconds=60))
x = torch.tensor([float(env["rank"] + 1)])
dist.all_reduce(x)
out = [torch.zeros(1) for _ in range(env["world_size"])]
dist.all_to_all(out, [torch.tensor([10.0 * env["rank"] + j]) for j in range(env["world_size"])])
rec["all_reduce"], rec["all_to_all"] = x.item(), [t.item() for t in out]
dist.destroy_process_group()
json.dump(rec, open(os.path.join(os.environ["OUT_DIR"], "rank-%d.json" % env["rank"]), "w"))
"""


def test_leftover_namespaces_of_a_dead_run_are_removed():
    """A test killed with SIGKILL leaves its namespaces (and what ran inside): the next start removes
    them; namespaces of a live process (another test session) are left alone."""
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale, live = NetnsCluster(["n1"]), NetnsCluster(["n1"])
    stale.tag = f"{PREFIX}{dead.pid}c0"
    stale.hub, stale.ns = f"{stale.tag}-hub", {"n1": f"{stale.tag}-n1"}
    try:
        stale.create()
        live.create()
        inside = subprocess.Popen(["nsenter", f"--net=/run/netns/{stale.ns['n1']}", "sleep", "300"])
        _wait_until("the process inside the stale namespace", lambda: inside.pid in namespace_pids(stale.ns["n1"]), 10)
        removed = cleanup_stale()
        assert sorted(removed) == sorted([stale.hub, stale.ns["n1"]])
        assert inside.wait(timeout=10) == -signal.SIGKILL
        names = list_namespaces()
        assert stale.hub not in names and live.hub in names and live.ns["n1"] in names
    finally:
        stale.destroy()
        live.destroy()
    assert not {stale.hub, live.hub} & set(list_namespaces())


@pytest.fixture
def on_login_node(slurm_multinode, monkeypatch):
    """This process's Slurm clients talk to the two-node cluster (for the in-process executor)."""
    for k in ("SLURM_CONF", "PATH"):
        monkeypatch.setenv(k, slurm_multinode.env[k])
    return slurm_multinode


def test_ranks_and_a_gloo_group_span_two_nodes(on_login_node, tmp_path):
    cluster = on_login_node
    run_dir = str(tmp_path / "job" / "run")
    out = tmp_path / "ranks"
    out.mkdir()
    plan = StagePlan(name="quantize", world_size=4, argv=[sys.executable, "-c", RANK_SCRIPT],
                     env={"OUT_DIR": str(out)}, log_path=os.path.join(run_dir, "quantize", "log.txt"))
    final, events = cluster.run_plans([plan], run_dir, echo=lambda line: None, nodes=2, timeout_s=180)
    log = open(plan.log_path).read()
    assert final == {"quantize": "COMPLETED"}, log + cluster.logs_tail()
    ranks = {r: json.loads((out / f"rank-{r}.json").read_text()) for r in range(4)}
    job_id = events[-1][2]["job_id"]
    assert events[-1][2]["node_list"] == "node[01-02]"
    for r, rec in ranks.items():
        e = rec["rank_env"]
        # block distribution: ranks 0-1 on node01, 2-3 on node02
        assert rec["node"] == f"node0{r // 2 + 1}", rec
        assert (e["rank"], e["world_size"], e["local_rank"], e["local_world_size"], e["node_rank"], e["num_nodes"]) \
            == (r, 4, r % 2, 2, r // 2, 2), rec
        # the script's MASTER_ADDR/PORT (scontrol show hostnames) == what the worker derives itself
        assert rec["master"] == "node01" and rec["port"] == str(derived_port(int(job_id)))
        assert rec["derived"] == {"MASTER_ADDR": "node01", "MASTER_PORT": rec["port"]}
        # gloo's own choice would be loopback (the machine's hostname resolves to 127.0.0.1) ...
        assert rec["hostname_resolves_to"].startswith("127."), rec
        # ... so the worker binds gloo to the interface towards MASTER_ADDR, and traffic crosses nodes
        assert rec["gloo_ifname"] == "eth0", rec
        assert rec["all_reduce"] == 10.0
        assert rec["all_to_all"] == [10.0 * src + r for src in range(4)]
    script = open(os.path.join(run_dir, "slurm", "quantize.sbatch")).read()
    assert "#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=2\n" in script and "#SBATCH --no-requeue\n" in script


# ---------------------------------------------------------------- the tiny pipeline across two nodes, with faults
def _worker_pids(cluster, node: str, stage: str, rank: Optional[int] = None) -> list[int]:
    """PIDs of ``stage``'s ranks running on ``node`` (optionally only global rank ``rank``)."""
    import psutil

    out = []
    for pid in cluster.node_pids(node):
        try:
            p = psutil.Process(pid)
            cmd = p.cmdline()
            if "launcher.worker" in cmd and stage in cmd and (
                    rank is None or p.environ().get("SLURM_PROCID") == str(rank)):
                out.append(pid)
        except psutil.Error:
            continue
    return out


def _wait_log_line(path: str, pattern: str, timeout_s: float = 900, interval_s: float = 0.05) -> float:
    """Poll a stage's log file (written live by srun) for ``pattern``; returns when it appeared."""
    rx = re.compile(pattern, re.MULTILINE)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with open(path, errors="replace") as f:
                if rx.search(f.read()):
                    return time.monotonic()
        except FileNotFoundError:
            pass
        time.sleep(interval_s)
    raise AssertionError(f"{pattern!r} not in {path} after {timeout_s:.0f} s")


def _wait_until(what: str, ok, timeout_s: float = 120, interval_s: float = 0.1) -> float:
    deadline = time.monotonic() + timeout_s
    while not ok():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(interval_s)
    return time.monotonic()


def _statuses(run_dir: str) -> dict[str, str]:
    meta = read_json(os.path.join(run_dir, "metadata.json"))
    return {s: meta["stages"][s].get("status") for s in ("quantize", "mmlu", "export", "vllm_smoke")}


def _failure_bound_s(cluster, collective_timeout_s: float) -> float:
    """collective_timeout_s + Slurm's own detection (a silent node: SlurmdTimeout plus up to one ping
    interval; a launch or kill RPC: MessageTimeout, twice) + the executor's polling."""
    t = cluster.TIMEOUTS
    return collective_timeout_s + t["SlurmdTimeout"] * 4 / 3 + 2 * t["MessageTimeout"] + 5


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_two_node_pipeline_with_faults_then_resume(slurm_multinode, request, tmp_path):
    """quantize EP4 / mmlu EP4 / export PP4 over node01 + node02 (2 ranks each), through four launches:

    A  node02's link down as quantize starts: srun cannot launch there -> quantize fails, nothing else runs;
    B  --resume: quantize runs; rank 3 (node02) SIGKILLed mid-gate -> mmlu fails, no results.json;
    C1 --resume: quantize skipped, mmlu passes; export's ranks held at its start (launcher.hold), node02's
       slurmd stopped -> NODE_FAIL, nothing of the export written;
    C2 --resume: export redone, its ranks held once every output and the manifest are written, node02's
       slurmd stopped -> NODE_FAIL, the verified export kept, the stage recorded node_fail;
    D  --resume after slurmd is back: export re-verified against its manifest and skipped; every output
       equals the single-node run's.
    """
    c = slurm_multinode
    ref = request.getfixturevalue("tiny_single_node_run")   # only once the two-node cluster is up (not skipped)
    assert ref.rc == 0, ref.output[-3000:]
    runs = tmp_path / "runs"
    base = [*c.launch_overrides(), "executor.nodes=2", f"runs_root={runs}"]
    env = c.env
    timeout_s = 120.0   # executor.collective_timeout_s (schema default), the bound's first term
    bound = _failure_bound_s(c, timeout_s)
    t_all = time.monotonic()
    print(f"\n[two-node tiny pipeline] failure bound: collective_timeout_s {timeout_s:.0f} s + Slurm's "
          f"detection = {bound:.0f} s", flush=True)

    def record(what: str, fault_to_report: Optional[float], launch_wall: Optional[float], note: str = "") -> None:
        a = f"fault -> reported {fault_to_report:5.1f} s" if fault_to_report is not None else ""
        b = f"launch wall {launch_wall:6.1f} s" if launch_wall is not None else ""
        print(f"  {what:<40} {a:<28} {b:<20} {note}", flush=True)
        if fault_to_report is not None:
            assert fault_to_report < bound, (what, fault_to_report, bound)

    # A: node02 unreachable at the start of quantize.  The batch script waits for a flag file
    # (executor.setup) so the link goes down after the allocation, before srun launches the ranks.
    flag = tmp_path / "go"
    wait_sh = tmp_path / "wait_for_flag.sh"
    wait_sh.write_text(f"while [ ! -e {flag} ]; do sleep 0.1; done\n")
    launch = Launch([*base, f"executor.setup=['sh {wait_sh}']"], env)
    run_dir = launch.run_dir()
    launch.wait_for(r"^\[launch\] quantize: RUNNING", 120)
    c.set_link("node02", False)
    t_fault = time.monotonic()
    flag.write_text("")
    t_report, m = launch.wait_for(r"^\[launch\] quantize: (FAILED|NODE_FAIL)", bound + 60)
    rc, t_end = launch.finish(120)
    record("A link down at quantize's start", t_report - t_fault, t_end - launch.t0, m.group(1))
    assert rc != 0, launch.output[-3000:]
    st = _statuses(run_dir)
    assert st["quantize"] in ("failed", "node_fail") and st["mmlu"] == st["export"] == st["vllm_smoke"] == "cancelled", st
    # the report names the node: slurmctld's view of it, and srun's launch error from the log
    assert "[launch] quantize: node node02: down* (Not responding)" in launch.output, launch.output[-3000:]
    assert re.search(r"\[launch\] quantize: srun: error: Task launch for StepId=\d+\.0 failed on node node02: "
                     r"Communication connection failure", launch.output), launch.output[-3000:]
    assert read_json(os.path.join(run_dir, "metadata.json"))["stages"]["quantize"]["errors"][0] \
        == "node node02: down* (Not responding)"
    assert not os.path.exists(os.path.join(run_dir, "quantize", "checkpoint"))
    assert not os.path.exists(os.path.join(run_dir, "quantize", "summary.json"))
    c.set_link("node02", True)
    c.return_node("node02")

    # B: resume; rank 3 (on node02) killed during the gate's forward steps
    launch = Launch([*base, "--resume", run_dir], env)
    mmlu_log = os.path.join(run_dir, "mmlu", "log.txt")
    _wait_log_line(mmlu_log, r"^\[mmlu r0 [\d:]+\] quantized: step 1/\d+", 1500)
    (pid,) = _worker_pids(c, "node02", "mmlu", rank=3)
    os.kill(pid, signal.SIGKILL)
    t_fault = time.monotonic()
    t_report, m = launch.wait_for(r"^\[launch\] mmlu: (FAILED|CANCELLED|NODE_FAIL)", bound + 60)
    rc, t_end = launch.finish(300)
    record("B rank 3 SIGKILLed mid-gate", t_report - t_fault, t_end - launch.t0, m.group(1))
    assert rc != 0, launch.output[-3000:]
    st = _statuses(run_dir)
    assert (st["quantize"], st["mmlu"]) == ("completed", "failed") and st["export"] == "cancelled", st
    log = open(mmlu_log).read()
    assert "quantized: step 5/5" not in log, "the gate finished before the kill: no fault was injected"
    assert "[launch] mmlu: srun: error: node02: task 3: Killed" in launch.output, launch.output[-3000:]
    # the surviving ranks fail at once, if srun has not killed them first: in the desync guard's
    # all-gather (naming ranks [0, 1, 2, 3]) or inside the expert all-to-all (naming node02's address)
    for line in re.findall(r"^\[mmlu r\d\] STAGE FAILED.*$", log, re.MULTILINE):
        print(f"    {line[:200]}", flush=True)
    assert not os.path.exists(os.path.join(run_dir, "mmlu", "results.json"))
    assert not os.path.exists(os.path.join(run_dir, "mmlu", "manifest.json"))

    # C: node02's slurmd stopped while export's ranks are held (launcher.hold, PTQ_TEST_HOLD) at a point
    # known to be inside the stage's work, first before any output (C1), then after every output and
    # the manifest were written (C2): what NODE_FAIL leaves depends only on that point, not on timing.
    def export_node_fail(point: str) -> tuple[Launch, str]:
        release = str(tmp_path / f"release-export-{point}")
        launch = Launch([*base, "--resume", run_dir], {**env, hold.ENV: f"export:{point}:{release}"})
        _wait_until(f"export's 4 ranks held at {point}",
                    lambda: all(os.path.exists(hold.marker(release, r)) for r in range(4)), 1500)
        assert len(_worker_pids(c, "node02", "export")) == 2   # ranks 2 and 3, held on node02
        c.stop_slurmd("node02")
        t_fault = time.monotonic()
        t_report, m = launch.wait_for(r"^\[launch\] export: (FAILED|CANCELLED|NODE_FAIL)", bound + 60)
        rc, t_end = launch.finish(300)
        record(f"C node02's slurmd stopped, export at {point}", t_report - t_fault, t_end - launch.t0, m.group(1))
        assert rc != 0 and m.group(1) == "NODE_FAIL", launch.output[-3000:]
        assert "[launch] export: node node02: down* (Not responding)" in launch.output, launch.output[-3000:]
        assert "DUE TO NODE FAILURE" in launch.output
        # released only now, after Slurm ended the job: node02's ranks go on and end (at start: in the
        # stage's first collective, their peers on node01 being gone; at end: they were done)
        open(release, "w").close()
        c.start_slurmd("node02")
        t_restart = time.monotonic()
        t_clean = _wait_until("the failed job's ranks on node02 to end",
                              lambda: not _worker_pids(c, "node02", "export"), timeout_s + 60)
        print(f"    node02's leftover export ranks gone {t_clean - t_fault:.1f} s after the fault "
              f"(slurmd restarted at {t_restart - t_fault:.1f} s)", flush=True)
        return launch, release

    export_dir, verify_json = os.path.join(run_dir, "export", "hf"), os.path.join(run_dir, "export", "verify.json")
    export_manifest = os.path.join(run_dir, "export", "manifest.json")
    # C1: --resume; quantize skipped, mmlu passes; export held at start -> NODE_FAIL, nothing written
    launch, _ = export_node_fail("start")
    st = _statuses(run_dir)
    assert (st["quantize"], st["mmlu"], st["export"]) == ("skipped", "completed", "node_fail"), st
    gate = read_json(os.path.join(run_dir, "mmlu", "results.json"))
    # the gate at EP4, balanced: each rank (two per node) its own shard, every rank 5 forward calls
    assert gate["pass"] is True and gate["shard_mode"] == "balanced", gate["plan"]
    assert gate["plan"]["shard_of_rank"] == [0, 1, 2, 3] and gate["plan"]["forward_calls_per_rank"] == [5] * 4
    assert not os.path.exists(export_dir)
    assert not os.path.exists(verify_json)
    assert not os.path.exists(export_manifest)
    assert "outputs kept" not in launch.output
    assert "outputs" not in read_json(os.path.join(run_dir, "metadata.json"))["stages"]["export"]

    # C2: --resume; export redone (no manifest), held at end -> NODE_FAIL, its verified outputs kept
    launch, _ = export_node_fail("end")
    st = _statuses(run_dir)
    assert (st["quantize"], st["mmlu"], st["export"]) == ("skipped", "skipped", "node_fail"), st
    assert "[launch] export: NODE_FAIL after the stage's work had completed: outputs kept (manifest written); " \
           "--resume re-verifies them" in launch.output, launch.output[-3000:]
    assert read_json(os.path.join(run_dir, "metadata.json"))["stages"]["export"]["outputs"].startswith("complete")
    assert read_json(verify_json)["ok"] is True and os.path.isdir(export_dir)
    listed = read_json(export_manifest)["outputs"]
    assert "verify.json" in listed and sorted(n for n in listed if n.startswith("hf/")) == sorted(
        f"hf/{n}" for n in os.listdir(export_dir))

    # D: --resume with every node back: export re-verified against its manifest and skipped; the
    # outputs equal the single-node run's
    launch = Launch([*base, "--resume", run_dir], env)
    rc, t_end = launch.finish(1500)
    record("D --resume to the end", None, t_end - launch.t0)
    assert rc == 0, launch.output[-4000:] + c.logs_tail()
    st = _statuses(run_dir)
    assert st == {"quantize": "skipped", "mmlu": "skipped", "export": "skipped", "vllm_smoke": "skipped"}, st
    assert read_json(os.path.join(run_dir, "metadata.json"))["stages"]["export"]["reason"] == (
        f"resume: outputs re-verified against the manifest ({len(listed)} files; the stage's job had ended node_fail)")
    jobs = json.load(open(os.path.join(run_dir, "slurm", "jobs.json")))
    assert "export" not in jobs["stages"]   # not resubmitted
    kept_from = jobs["previous"][-1]["stages"]["export"]   # the job (C2) whose outputs were kept
    assert kept_from["final_state"] == "NODE_FAIL" and kept_from["final_info"]["node_list"] == "node[01-02]"
    for stage in ("quantize", "mmlu", "export"):   # rank 0's preflight line: both nodes, gloo on eth0
        assert re.search(r"across 2 nodes \(master node01:\d+, gloo via eth0\)",
                         open(os.path.join(run_dir, stage, "log.txt")).read()), stage
    counts = compare_outputs(ref.run_dir, run_dir, "hf")
    assert c.active_jobs() == []
    print(f"  total {time.monotonic() - t_all:.0f} s (single-node reference run {ref.wall_s:.0f} s); "
          f"equal to the single-node run: {counts}", flush=True)
