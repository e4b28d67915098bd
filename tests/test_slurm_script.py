"""Golden-file tests of the sbatch renderer and the scontrol parser (pure, no Slurm needed).

Regenerate the goldens after an intended change with
    UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/test_slurm_script.py
and review the diff of tests/golden/*.sbatch.
"""
from __future__ import annotations

import os

import pytest
from omegaconf import OmegaConf

from launcher.schema import SlurmExecutorConfig
from launcher.executors.base import StagePlan
from launcher.slurm_env import expand_hostlist, rendezvous_defaults, tasks_on_node
from launcher.contract import split_secrets
from launcher.executors.slurm_script import ScriptError, dependency_spec, render_sbatch
from launcher.executors.slurm_state import (
    failure_lines_of_log,
    job_info,
    parse_sbatch_parsable,
    parse_scontrol_jobs,
    parse_scontrol_line,
)

GOLDEN = os.path.join(os.path.dirname(__file__), "golden")
RUN_DIR = "/runs/tiny_moe/20261202-101500"


def _cfg(**kv):
    cfg = OmegaConf.structured(SlurmExecutorConfig)
    for k, v in kv.items():
        OmegaConf.update(cfg, k, v, merge=False)
    return cfg


def _plan(name="quantize", world=4, env=None, allow_to_fail=False):
    return StagePlan(name=name, world_size=world,
                     argv=["python", "-m", "launcher.worker", name, RUN_DIR],
                     env=dict(env or {}), log_path=f"{RUN_DIR}/{name}/log.txt", allow_to_fail=allow_to_fail)


CASES = {
    # schema defaults: one node, CPU, no container, fixed port 29500
    "defaults_4ranks": (_plan(), _cfg()),
    # everything set: 2 nodes x 8 GPUs, container + mounts, setup lines, env incl. a secret, derived port
    "full_2nodes_container": (
        _plan("mmlu", 16, env={"HF_HOME": "/lustre/hf cache", "HF_TOKEN": "hf_do_not_write"}),
        _cfg(partition="batch", account="llm_ptq", qos="high", time="04:00:00", nodes=2, gpus_per_node=8,
             cpus_per_task=16, mem="0", container_image="nvcr.io/nvidia/nemo:25.09",
             container_mounts=["/lustre:/lustre", "/home/me/ckpt:/ckpt"],
             setup=["module load cuda/12.8", "source /opt/env.sh"], python="/usr/bin/python3",
             env={"NCCL_DEBUG": "WARN", "WANDB_API_KEY": "x"}, master_port=0, omp_num_threads=4),
    ),
    # a stage that may fail, one rank, plain minutes as the limit
    "export_1rank": (_plan("export", 1, allow_to_fail=True), _cfg(time="30", partition="debug")),
    # site flags passed through verbatim (executor.sbatch_args, executor.srun_args)
    "site_args": (_plan("quantize", 8), _cfg(nodes=2, gpus_per_node=4, sbatch_args=["--exclusive", "--constraint=h100"],
                                            srun_args=["--mpi=pmix", "--cpu-bind=none"])),
    # what the two-node test cluster runs (tests/test_slurm_multinode.py): CPU, 2 nodes x 2 ranks
    "cpu_2nodes": (_plan("mmlu", 4), _cfg(nodes=2, partition="debug", time="00:10:00", env={"PYTHONPATH": "/src"},
                                          master_port=0)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_golden(case):
    plan, cfg = CASES[case]
    text = render_sbatch(plan, cfg, RUN_DIR)
    path = os.path.join(GOLDEN, f"{case}.sbatch")
    if os.environ.get("UPDATE_GOLDEN"):
        os.makedirs(GOLDEN, exist_ok=True)
        with open(path, "w") as f:
            f.write(text)
    assert os.path.exists(path), f"missing golden {path}: run with UPDATE_GOLDEN=1"
    with open(path) as f:
        assert text == f.read(), f"{case}: rendered script differs from {path} (UPDATE_GOLDEN=1 to accept)"


def test_secrets_not_written():
    plan, cfg = CASES["full_2nodes_container"]
    text = render_sbatch(plan, cfg, RUN_DIR)
    assert "hf_do_not_write" not in text and "WANDB_API_KEY=" not in text
    public, secret = split_secrets({"HF_TOKEN": "a", "HF_HOME": "b", "AWS_SECRET_ACCESS_KEY": "c"})
    assert public == {"HF_HOME": "b"} and set(secret) == {"HF_TOKEN", "AWS_SECRET_ACCESS_KEY"}


def test_render_is_pure(monkeypatch):
    """No environment, clock, process id, working directory or file system goes into the script:
    with all of them poisoned, every case still renders exactly its golden."""
    import time

    want = {case: open(os.path.join(GOLDEN, f"{case}.sbatch")).read() for case in CASES}

    def poisoned(*args, **kwargs):
        raise AssertionError("render_sbatch read the clock, the pid, the cwd or the file system")

    for name in ("time", "monotonic", "strftime", "localtime", "gmtime"):
        monkeypatch.setattr(time, name, poisoned)
    for name in ("getpid", "getcwd", "listdir", "stat"):
        monkeypatch.setattr(os, name, poisoned)
    for name in ("exists", "isfile", "isdir", "abspath", "expanduser"):
        monkeypatch.setattr(os.path, name, poisoned)
    monkeypatch.setattr(os, "environ", {"HOME": "/poison", "USER": "poison", "SLURM_JOB_ID": "666",
                                        "PATH": "/poison", "HF_TOKEN": "poison", "PYTHONPATH": "/poison"})
    got = {case: render_sbatch(plan, cfg, RUN_DIR) for case, (plan, cfg) in CASES.items()}
    monkeypatch.undo()
    assert got == want


@pytest.mark.parametrize("kv,plan,match", [
    ({"nodes": 3}, _plan(world=4), r"world size 4 does not split evenly over executor.nodes=3; valid node counts: \[1, 2, 4\]"),
    ({"time": "1h"}, _plan(), r"executor.time='1h'"),
    ({"gpus_per_node": 4}, _plan(world=8), r"8 ranks per node .* executor.gpus_per_node=4: .*executor.nodes >= 2"),
    ({"env": {"BAD-NAME": "1"}}, _plan(), r"not a valid environment variable name"),
])
def test_errors_name_the_key(kv, plan, match):
    with pytest.raises(ScriptError, match=match):
        render_sbatch(plan, _cfg(**kv), RUN_DIR)


def test_stage_with_fewer_ranks_than_nodes_runs_on_fewer_nodes():
    """vllm_smoke (one rank) in a two-node pipeline: one node, not an error."""
    text = render_sbatch(_plan("vllm_smoke", 1), _cfg(nodes=2), RUN_DIR)
    assert "#SBATCH --nodes=1\n#SBATCH --ntasks-per-node=1\n" in text
    assert "srun --ntasks=1 --ntasks-per-node=1 " in text
    text = render_sbatch(_plan("export", 2), _cfg(nodes=4), RUN_DIR)
    assert "#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=1\n" in text


def test_site_requeue_overrides_no_requeue():
    text = render_sbatch(_plan(), _cfg(sbatch_args=["--requeue"]), RUN_DIR)
    assert text.index("#SBATCH --no-requeue") < text.index("#SBATCH --requeue")


def test_dependency_spec():
    names = ["quantize", "mmlu", "export", "vllm_smoke"]
    ids = ["11", "12", "13", "14"]
    plans = [_plan(n) for n in names]
    assert [dependency_spec(i, plans, ids) for i in range(4)] == [None, "afterok:11", "afterok:12", "afterok:13"]
    # mmlu may fail: export runs after it ends any way, but only if quantize succeeded
    plans[1].allow_to_fail = True
    assert dependency_spec(2, plans, ids) == "afterany:12,afterok:11"
    # two tolerant stages in a row still anchor on the last strict one
    plans[2].allow_to_fail = True
    assert dependency_spec(3, plans, ids) == "afterany:13,afterok:11"
    # everything tolerant: plain afterany chain
    for p in plans:
        p.allow_to_fail = True
    assert dependency_spec(3, plans, ids) == "afterany:13"


# captured from slurm-wlm 22.05.8 on this machine (scripts/install_slurm.sh installs it)
SCONTROL_FAILED = (
    "JobId=46218307 JobName=a.sh UserId=root(0) GroupId=root(0) MCS_label=N/A Priority=4294901759 Nice=0 "
    "Account=(null) QOS=(null) JobState=FAILED Reason=NonZeroExitCode Dependency=(null) Requeue=1 Restarts=0 "
    "BatchFlag=1 Reboot=0 ExitCode=3:0 RunTime=00:00:00 TimeLimit=UNLIMITED TimeMin=N/A "
    "SubmitTime=2026-12-02T13:15:11 EligibleTime=2026-12-02T13:15:11 AccrueTime=2026-12-02T13:15:11 "
    "StartTime=2026-12-02T13:15:14 EndTime=2026-12-02T13:15:14 Deadline=N/A Partition=debug "
    "AllocNode:Sid=localhost:3447 NodeList=localhost BatchHost=localhost NumNodes=1 NumCPUs=4 NumTasks=4 "
    "CPUs/Task=1 ReqB:S:C:T=0:0:*:* TRES=cpu=4,node=1,billing=4 Socks/Node=* NtasksPerN:B:S:C=0:0:*:* "
    "Command=/tmp/my dir/a.sh WorkDir=/tmp StdErr=/tmp/sx/a-46218307.out StdIn=/dev/null "
    "StdOut=/tmp/sx/a-46218307.out Power= ")
SCONTROL_NEVER = (
    "JobId=46218308 JobName=wrap UserId=root(0) GroupId=root(0) JobState=PENDING "
    "Reason=DependencyNeverSatisfied Dependency=afterok:46218307(failed) ExitCode=0:0 RunTime=00:00:00 "
    "TimeLimit=UNLIMITED StartTime=Unknown EndTime=Unknown NodeList= ")


def test_parse_scontrol():
    fields = parse_scontrol_line(SCONTROL_FAILED)
    assert fields["Command"] == "/tmp/my dir/a.sh"          # value with a space
    assert fields["TRES"] == "cpu=4,node=1,billing=4"       # value with '='
    assert fields["Power"] == ""
    info = job_info(fields)
    assert (info.state, info.reason, info.exit_code, info.signal) == ("FAILED", "NonZeroExitCode", 3, 0)
    assert info.final and not info.never_satisfied and info.node_list == "localhost"
    jobs = parse_scontrol_jobs(SCONTROL_FAILED + "\n" + SCONTROL_NEVER + "\n")
    assert set(jobs) == {"46218307", "46218308"}
    never = job_info(jobs["46218308"])
    assert never.never_satisfied and not never.final and never.start_time is None and never.node_list is None
    assert never.run_time is None
    # the same job once cancelled, as scontrol printed it in CI: RunTime counted from the epoch
    cancelled = job_info(parse_scontrol_line(SCONTROL_NEVER.replace("JobState=PENDING", "JobState=CANCELLED")
                                             .replace("RunTime=00:00:00", "RunTime=20792-08:24:39")))
    assert cancelled.final and cancelled.start_time is None and cancelled.run_time is None
    assert job_info(fields).run_time is not None        # a job that ran keeps its run time


def test_parse_sbatch():
    assert parse_sbatch_parsable("1234\n") == "1234"
    assert parse_sbatch_parsable("1234;localci\n") == "1234"
    with pytest.raises(ValueError):
        parse_sbatch_parsable("sbatch: error: oops")


# ---------------------------------------------------------------- what a rank reads from srun's environment
HOSTLISTS = {
    "node[01-02]": ["node01", "node02"],
    "localhost": ["localhost"],
    "n[1-10]": [f"n{i}" for i in range(1, 11)],
    "n[001-3]": ["n001", "n002", "n003"],
    "n[8-010]": ["n8", "n9", "n10"],             # width of the lower bound, like Slurm
    "a[1-3,10],b7,c[008-010]": ["a1", "a2", "a3", "a10", "b7", "c008", "c009", "c010"],
    "r[1-2]n[1-2]": ["r1n1", "r1n2", "r2n1", "r2n2"],
    "gpu-a[2-2],gpu-b": ["gpu-a2", "gpu-b"],
}


@pytest.mark.parametrize("spec", sorted(HOSTLISTS))
def test_expand_hostlist(spec):
    assert expand_hostlist(spec) == HOSTLISTS[spec]


@pytest.mark.parametrize("spec,match", [("n[1-2", r"'\[' without '\]'"), ("n1-2]", r"'\]' without '\['"),
                                        ("n[3-1]", "runs backwards"), ("n[a-b]", "bad range")])
def test_expand_hostlist_errors(spec, match):
    with pytest.raises(ValueError, match=match):
        expand_hostlist(spec)


def test_expand_hostlist_agrees_with_scontrol(tmp_path):
    """The same expansions from Slurm's own `scontrol show hostnames` (no daemon needed)."""
    import shutil
    import subprocess

    if shutil.which("scontrol") is None:
        pytest.skip("scontrol not installed (scripts/install_slurm.sh)")
    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=x\nSlurmctldHost=localhost\nNodeName=localhost\nPartitionName=d Nodes=ALL\n")
    for spec, hosts in HOSTLISTS.items():
        r = subprocess.run(["scontrol", "show", "hostnames", spec], capture_output=True, text=True,
                           env={**os.environ, "SLURM_CONF": str(conf)}, timeout=30)
        assert r.returncode == 0 and r.stdout.split() == hosts, (spec, r.stdout, r.stderr)


def test_tasks_on_node():
    assert [tasks_on_node("2(x2)", i) for i in range(3)] == [2, 2, None]
    assert [tasks_on_node("3,2", i) for i in range(2)] == [3, 2]
    assert [tasks_on_node("2(x3),1", i) for i in range(4)] == [2, 2, 2, 1]
    assert tasks_on_node("", 0) is None and tasks_on_node("garbage", 0) is None


def test_rendezvous_defaults_match_the_script():
    srun = {"SLURM_PROCID": "3", "SLURM_JOB_ID": "46218307", "SLURM_STEP_NODELIST": "node[01-02]",
            "SLURM_JOB_NODELIST": "login,node[01-02]"}
    port = 20000 + 46218307 % 20000        # the script's $(( 20000 + SLURM_JOB_ID % 20000 ))
    assert f"$(( {20000} + SLURM_JOB_ID % {20000} ))" in render_sbatch(_plan(), _cfg(master_port=0), RUN_DIR)
    assert rendezvous_defaults(srun) == {"MASTER_ADDR": "node01", "MASTER_PORT": str(port)}
    assert rendezvous_defaults({**srun, "SLURM_STEP_NODELIST": ""})["MASTER_ADDR"] == "login"
    assert rendezvous_defaults({**srun, "RANK": "3"}) == {}          # torchrun / the local agent set it
    assert rendezvous_defaults({"SLURM_JOB_ID": "7"}) == {}          # inside an allocation, not under srun


def test_validate_refuses_nodes_that_do_not_split_a_stage():
    """Before anything is submitted: executor.nodes must split each stage's ranks (vllm_smoke's one
    rank runs on one node, so nodes=2 is fine for the tiny example; 3 is not)."""
    from launcher.config.compose import ConfigError, compose_example
    from launcher.config.validate import validate

    tiny = os.path.join(os.path.dirname(GOLDEN), "..", "examples", "tiny", "Qwen3-MoE-tiny", "megatron_lm_ptq.yaml")
    validate(compose_example(tiny, ["executor=slurm", "executor.nodes=2"]), check_paths=False)
    with pytest.raises(ConfigError) as e:
        validate(compose_example(tiny, ["executor=slurm", "executor.nodes=3"]), check_paths=False)
    lines = [ln for ln in str(e.value).splitlines() if "executor.nodes=3" in ln]
    assert [ln.split(": ", 1)[1].split(" has ")[0] for ln in lines] == ["stages.quantize", "stages.mmlu", "stages.export"]
    assert "4 ranks, which do not split evenly over 3 nodes (valid: 1, 2, 4)" in lines[0]


# a stage log rebuilt from what CI run 2026-12-03 printed (two nodes; rank 3 on node02 SIGKILLed
# mid-gate; gloo paths shortened, the progress line added): the surviving ranks fail on the broken
# connection and srun reports task 2's exit before task 3's kill
KILLED_RANK_LOG = """\
[mmlu r0 08:52:37] quantized: step 2/5
[mmlu r0] STAGE FAILED with an exception: RuntimeError: [gloo/transport/tcp/pair.cc:537] Read error [10.213.0.12]:58528: Connection reset by peer. This is typically caused by a remote worker hanging
[mmlu r2] STAGE FAILED with an exception: RuntimeError: [gloo/transport/tcp/pair.cc:537] Read error [10.213.0.12]:40669: Connection reset by peer. This is typically caused by a remote worker hanging
[mmlu r1] STAGE FAILED with an exception: RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed by peer [10.213.0.12]:44768. This is typically caused by a remote worker crashing.
srun: error: node02: task 2: Exited with exit code 1
srun: launch/slurm: _step_signal: Terminating StepId=46288746.0
slurmstepd-node01: error: *** STEP 46288746.0 ON node01 CANCELLED AT 2026-12-03T08:52:38 ***
srun: error: node02: task 3: Killed
srun: error: node01: tasks 0-1: Exited with exit code 1
srun: Force Terminated StepId=46288746.0
"""


def test_failure_lines_put_the_killed_task_first():
    assert failure_lines_of_log(KILLED_RANK_LOG, limit=3) == [
        "srun: error: node02: task 3: Killed",
        "[mmlu r0] STAGE FAILED with an exception: RuntimeError: [gloo/transport/tcp/pair.cc:537] Read error "
        "[10.213.0.12]:58528: Connection reset by peer. This is typically caused by a remote worker hanging",
        "[mmlu r2] STAGE FAILED with an exception: RuntimeError: [gloo/transport/tcp/pair.cc:537] Read error "
        "[10.213.0.12]:40669: Connection reset by peer. This is typically caused by a remote worker hanging",
    ]


def test_failure_lines_tiers_and_log_order():
    log = "\n".join([
        "srun: error: node01: tasks 0-1: Exited with exit code 3",
        "[mmlu r1] STAGE FAILED: desync guard: ranks [0, 1, 2, 3] did not all reach step 2",
        "[mmlu r1] STAGE FAILED: desync guard: ranks [0, 1, 2, 3] did not all reach step 2",   # repeated
        "slurmstepd: error: *** JOB 12 ON node02 CANCELLED AT 2026-12-03T08:00:00 DUE TO NODE FAILURE ***",
        "[export r0] PREFLIGHT FAILED: no space left on /runs",
        "srun: error: Task launch for StepId=12.0 failed on node node02: Communication connection failure",
        "unrelated: srun: error: not at the start of the line",
    ])
    assert failure_lines_of_log(log) == [
        "slurmstepd: error: *** JOB 12 ON node02 CANCELLED AT 2026-12-03T08:00:00 DUE TO NODE FAILURE ***",
        "srun: error: Task launch for StepId=12.0 failed on node node02: Communication connection failure",
        "[mmlu r1] STAGE FAILED: desync guard: ranks [0, 1, 2, 3] did not all reach step 2",
        "[export r0] PREFLIGHT FAILED: no space left on /runs",
    ]
    assert failure_lines_of_log(log, limit=6)[-1] == "srun: error: node01: tasks 0-1: Exited with exit code 3"
    assert failure_lines_of_log("x" * 10 + "\n[a r0] STAGE FAILED " + "y" * 400) == ["[a r0] STAGE FAILED " + "y" * 280]
    assert failure_lines_of_log("all good\n") == []
