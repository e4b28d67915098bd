"""How the local agent starts a stage's ranks (launcher.executors.rank_start, local_agent): the choice
between a fork from the preloaded agent and a spawn, the agent's command line, the rank names; and
the run's preloaded process that forks the agents themselves (launcher.executors.local_zygote).

The forked path runs for real in every local pipeline test on this CPU machine (torch is a CPU
build); ``test_resume_with_unreachable_bound_fails_the_gate`` (test_pipeline_local) keeps the spawned path running
on CPU, and the GPU checks run it on CUDA.
"""
import os
import subprocess
import sys
import time

import pytest

from launcher.executors import rank_start
from launcher.executors.local import LocalExecutor
from launcher.executors.local_agent import USAGE, parse

PY = sys.executable
WORKER = [PY, "-m", "launcher.worker", "quantize", "/runs/x"]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_auto_forks_where_the_ranks_cannot_use_cuda():
    assert rank_start.choose("auto", WORKER, {"CUDA_VISIBLE_DEVICES": ""}, "13.0") == (
        "fork", "CUDA is hidden from the ranks")
    assert rank_start.choose("auto", WORKER, {}, None) == ("fork", "torch is a CPU build")
    assert rank_start.choose("auto", WORKER, {"CUDA_VISIBLE_DEVICES": ""}, None)[0] == "fork"


def test_auto_spawns_ranks_that_may_use_a_gpu():
    for environ in ({}, {"CUDA_VISIBLE_DEVICES": "0,1"}):
        assert rank_start.choose("auto", WORKER, environ, "13.0") == (
            "spawn", "the ranks may use a GPU (CUDA must not be initialised before a fork)")


def test_spawn_is_spawn_everywhere():
    for environ, cuda in (({}, None), ({"CUDA_VISIBLE_DEVICES": ""}, "13.0")):
        assert rank_start.choose("spawn", WORKER, environ, cuda) == ("spawn", "executor.rank_start=spawn")


def test_only_this_interpreter_running_a_forkable_module_is_forked():
    assert rank_start.forkable(WORKER) == ["launcher.worker", "quantize", "/runs/x"]
    other_module = [PY, "-m", "launcher.cli", "x.yaml"]
    other_python = ["/usr/bin/python3-not-this-one", "-m", "launcher.worker", "quantize", "/runs/x"]
    script = [PY, "worker.py", "quantize"]
    for cmd in (other_module, other_python, script, [PY]):
        assert rank_start.forkable(cmd) is None, cmd
        method, why = rank_start.choose("auto", cmd, {"CUDA_VISIBLE_DEVICES": ""}, None)
        assert (method, why) == ("spawn", f"the command is not `{PY} -m` one of launcher.worker"), cmd


def test_the_agent_parses_its_command_line_and_refuses_anything_else():
    assert parse(["4", "29500", "--", *WORKER]) == (4, 29500, "spawn", WORKER)
    assert parse(["4", "29500", "--start", "auto", "--", *WORKER]) == (4, 29500, "auto", WORKER)
    for bad in (["4", "29500", *WORKER], ["4", "--", *WORKER], ["4", "29500", "--start", "fork", "--", *WORKER],
                ["four", "29500", "--", *WORKER], ["4", "29500", "--"]):
        with pytest.raises(ValueError) as e:
            parse(bad)
        assert str(e.value) == USAGE, bad


def test_the_executor_passes_rank_start_to_the_agent():
    from omegaconf import OmegaConf

    from launcher.executors.base import StagePlan

    plan = StagePlan(name="quantize", world_size=4, argv=WORKER, env={}, log_path="/runs/x/quantize/log.txt")
    for cfg, start in (({"master_port": None}, "auto"), ({"master_port": None, "rank_start": "spawn"}, "spawn")):
        argv = LocalExecutor(OmegaConf.create(cfg), "/runs/x", echo=False).agent_argv(plan, 29500)
        assert argv == [PY, "-m", "launcher.executors.local_agent", "4", "29500", "--start", start, "--", *WORKER]


def test_no_preloaded_process_is_started_where_the_ranks_may_see_a_gpu(tmp_path, monkeypatch):
    from omegaconf import OmegaConf

    from launcher.executors.base import StagePlan

    control = tmp_path / "nvidiactl"
    assert not rank_start.gpu_may_be_visible({}, str(control))
    control.write_text("")
    assert rank_start.gpu_may_be_visible({}, str(control))
    assert rank_start.gpu_may_be_visible({"CUDA_VISIBLE_DEVICES": "0"}, str(control))
    assert not rank_start.gpu_may_be_visible({"CUDA_VISIBLE_DEVICES": ""}, str(control))

    monkeypatch.setattr(rank_start, "NVIDIA_CONTROL_DEVICE", str(control))
    plan = StagePlan(name="quantize", world_size=4, argv=WORKER, env={}, log_path=str(tmp_path / "log.txt"))
    cases = [({"master_port": None}, {}, False),                                 # a GPU host, CUDA visible
             ({"master_port": None}, {"CUDA_VISIBLE_DEVICES": ""}, True),       # CUDA hidden (device=cpu)
             ({"master_port": None, "device": "cuda"}, {"CUDA_VISIBLE_DEVICES": ""}, False),
             ({"master_port": None, "rank_start": "spawn"}, {"CUDA_VISIBLE_DEVICES": ""}, False)]
    for cfg, env, expected in cases:
        ex = LocalExecutor(OmegaConf.create(cfg), str(tmp_path), echo=False)
        assert ex.may_fork_agents(plan, env) is expected, (cfg, env)
    other = StagePlan(name="x", world_size=1, argv=[PY, "-c", "pass"], env={}, log_path=str(tmp_path / "log.txt"))
    assert not LocalExecutor(OmegaConf.create({}), str(tmp_path), echo=False).may_fork_agents(
        other, {"CUDA_VISIBLE_DEVICES": ""})


def test_a_bad_rank_start_is_refused_naming_the_key_and_the_values():
    proc = subprocess.run([PY, "-m", "launcher.cli", "validate", "examples/tiny/Qwen3-MoE-tiny/megatron_lm_ptq.yaml",
                           "executor.rank_start=fork"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    out = proc.stdout + proc.stderr
    assert "executor.rank_start" in out and "auto" in out and "spawn" in out, out


def test_a_process_is_named_for_its_stage_and_rank():
    code = ("from launcher.executors.rank_start import name_process\n"
            "name_process('quantize:r3'); print(open('/proc/self/comm').read().strip())\n"
            "name_process('vllm_smoke:r12-and-more'); print(open('/proc/self/comm').read().strip())")
    proc = subprocess.run([PY, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["quantize:r3", "vllm_smoke:r12-"]


@pytest.mark.torch
def test_the_preload_leaves_the_mamba_mixer_and_the_patches_to_the_rank():
    code = ("import sys; from launcher.executors import rank_start\n"
            "rank_start.preload()\n"
            "print(sorted(m for m in rank_start.PRELOAD if m in sys.modules))\n"
            "print([m for m in rank_start.NOT_PRELOADED if m in sys.modules])")
    proc = subprocess.run([PY, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [str(sorted(rank_start.PRELOAD)), "[]"]


def _agent_argv(port: int, run_dir) -> list[str]:
    return ["1", str(port), "--start", "auto", "--", PY, "-m", "launcher.worker", "quantize", str(run_dir)]


@pytest.mark.torch
def test_the_zygote_forks_agents_whose_ranks_exit_codes_and_tracebacks_come_back(tmp_path):
    """The run's preloaded process (launcher.executors.local_zygote): an agent forked from it forks its
    rank; the rank's exception (no config.yaml in its run directory) is printed with its traceback on
    the stage's pipe and its exit code reaches the executor; a second agent from the same zygote
    imports nothing again.  Once the zygote is gone, forking an agent says so."""
    from launcher.executors.local import free_port
    from launcher.executors.local_zygote import Zygote, ZygoteGone

    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    with open(tmp_path / "zygote.log", "w") as log:
        zygote, why = Zygote.start([PY, "-m", "launcher.worker", "quantize", str(tmp_path)], env, log.fileno())
    assert zygote is not None and why == "CUDA is hidden from the ranks", why
    try:
        for attempt in range(2):
            agent = zygote.fork_agent(_agent_argv(free_port(), tmp_path / "absent"), env, ROOT)
            out = agent.stdout.read()
            agent.stdout.close()
            assert agent.wait(timeout=60) == 1, out
            assert f"forked after one import of torch, megatron.core, modelopt.torch.quantization, transformers " \
                   f"({zygote.preload_s:.1f}s, once for the run; CUDA is hidden from the ranks)" in out, out
            assert "Traceback" in out and "FileNotFoundError" in out and "absent/config.yaml" in out, out
            assert "[local-agent] rank 0 exited with 1" in out, out
        os.kill(zygote.proc.pid, 9)
        zygote.proc.wait()
        with pytest.raises(ZygoteGone):
            zygote.fork_agent(_agent_argv(free_port(), tmp_path / "absent"), env, ROOT)
    finally:
        zygote.close()
    assert "Traceback" not in (tmp_path / "zygote.log").read_text()   # its own output: import warnings at most


@pytest.mark.torch
def test_the_zygote_declines_ranks_it_must_not_fork(tmp_path):
    from launcher.executors.local_zygote import Zygote

    with open(tmp_path / "zygote.log", "w") as log:
        zygote, why = Zygote.start([PY, "-m", "launcher.cli", "x.yaml"], {**os.environ, "CUDA_VISIBLE_DEVICES": ""},
                                   log.fileno())
    assert zygote is None and why == f"the command is not `{PY} -m` one of launcher.worker", why


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return any(line.startswith("State:") and "Z" in line.split()[1] for line in f)
    except FileNotFoundError:
        return True


def test_a_failing_forked_rank_ends_the_multiprocessing_children_it_leaves(tmp_path, monkeypatch):
    """A forked rank that fails leaves by os._exit, which skips multiprocessing's exit handler: the
    child it started (a checkpoint writer, say) must still end, or it keeps the stage's output open."""
    from launcher.executors import rank_start

    monkeypatch.setattr(rank_start, "FORKABLE", (*rank_start.FORKABLE, "launcher_testing.forked_rank_probe"))
    pidfile = tmp_path / "child.pid"
    pid = os.fork()
    if pid == 0:   # the rank
        try:
            rank_start.run_forked_rank("launcher_testing.forked_rank_probe", str(pidfile))
        finally:
            os._exit(99)   # not reached: the failure exits with its code
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 3
    child = int(pidfile.read_text())
    deadline = time.monotonic() + 10
    while not _gone(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(child), f"the rank's multiprocessing child {child} outlived it"


def _start_listener(tmp_path, env: dict) -> tuple[subprocess.Popen, str]:
    """The shared preloaded process, once its socket is there (its imports done)."""
    path = str(tmp_path / "shared.sock")
    log = open(tmp_path / "shared.log", "w")
    proc = subprocess.Popen([PY, "-m", "launcher.executors.local_zygote", "--listen", path], cwd=ROOT, env=env,
                            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    deadline = time.monotonic() + 240
    while not os.path.exists(path):
        assert proc.poll() is None, (tmp_path / "shared.log").read_text()
        assert time.monotonic() < deadline, "the shared preloaded process did not listen in 240 s"
        time.sleep(0.2)
    return proc, path


@pytest.mark.torch
def test_the_shared_zygote_forks_the_agents_of_several_runs_and_refuses_another_environment(tmp_path):
    """``local_zygote --listen PATH``: each connection is one run, served as a run's own preloaded process
    would serve it; a run whose import-time environment differs is refused naming the variables; a
    path nobody listens on is refused in the socket's words; SIGTERM ends the process and its socket."""
    from launcher.executors.local import free_port
    from launcher.executors.local_zygote import Zygote

    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("PTQ_LOCAL_ZYGOTE", None)
    proc, path = _start_listener(tmp_path, env)
    cmd = [PY, "-m", "launcher.worker", "quantize", str(tmp_path)]
    try:
        for run in range(2):
            zygote, why = Zygote.connect(path, cmd, env)
            assert zygote is not None and why == f"CUDA is hidden from the ranks; shared: {path}", why
            agent = zygote.fork_agent(_agent_argv(free_port(), tmp_path / "absent"), env, ROOT)
            out = agent.stdout.read()
            agent.stdout.close()
            assert agent.wait(timeout=60) == 1, out
            assert f"({zygote.preload_s:.1f}s, once for every run served by {path}; CUDA is hidden from the ranks)" \
                in out, out
            assert "FileNotFoundError" in out and "[local-agent] rank 0 exited with 1" in out, out
            zygote.close()
        zygote, why = Zygote.connect(path, cmd, {**env, "OMP_NUM_THREADS": "2", "PYTHONPATH": "/x"})
        assert zygote is None and why == (f"the shared preloaded process {path} started with other values of "
                                          f"OMP_NUM_THREADS, PYTHONPATH"), why
        zygote, why = Zygote.connect(path, [PY, "-m", "launcher.cli", "x.yaml"], env)
        assert zygote is None and why == f"the command is not `{PY} -m` one of launcher.worker", why
        zygote, why = Zygote.connect(str(tmp_path / "nobody.sock"), cmd, env)
        assert zygote is None and why.startswith(f"PTQ_LOCAL_ZYGOTE={tmp_path / 'nobody.sock'}: [Errno 2]"), why
        assert proc.poll() is None
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0
    assert not os.path.exists(path)


@pytest.mark.torch
@pytest.mark.slow
def test_launch_forks_its_agents_from_the_shared_zygote_its_environment_names(tmp_path, tiny_dir):
    """Two `launch --preflight` runs of the tiny example with ``PTQ_LOCAL_ZYGOTE``: every stage's agent
    of both runs comes from the one shared process; with ``PTQ_LOCAL_ZYGOTE=0`` the run has its own."""
    from launcher.pipeline import QUIET_WARNINGS

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONWARNINGS": os.environ.get("PYTHONWARNINGS", QUIET_WARNINGS)}
    env.pop("PTQ_LOCAL_ZYGOTE", None)
    proc, path = _start_listener(tmp_path, env)
    example = os.path.join(ROOT, "examples", "tiny", "Qwen3-MoE-tiny", "megatron_lm_ptq.yaml")
    try:
        for run, shared in enumerate((path, path, "0")):
            out = subprocess.run([PY, "-m", "launcher.cli", example, f"runs_root={tmp_path / str(run)}", "--preflight"],
                                 cwd=ROOT, env={**env, "PTQ_LOCAL_ZYGOTE": shared}, capture_output=True, text=True,
                                 timeout=600)
            text = out.stdout + out.stderr
            assert out.returncode == 0, text[-3000:]
            agents = text.count("[local-agent] 4 rank(s) forked after one import of")
            assert agents == 3, text[-3000:]
            if shared == "0":
                assert "s, once for the run; torch is a CPU build)" in text and "served by" not in text, text[-3000:]
            else:
                assert text.count(f"s, once for every run served by {path}; torch is a CPU build)") == 4, text[-3000:]
        assert proc.poll() is None
    finally:
        proc.terminate()
        proc.wait(timeout=30)
