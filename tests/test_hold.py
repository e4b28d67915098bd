"""launcher.hold: the test hook that holds a stage's ranks at a named point until a file appears
(what the two-node fault test uses to inject a fault inside a stage's work without timing), and
the pipeline's record of a job that ended NODE_FAIL after its stage had written its manifest."""
from __future__ import annotations

import os
import sys
import threading
import time

import pytest
from omegaconf import OmegaConf

from launcher import hold
from launcher.config.compose import ConfigError, compose_example
from launcher.config.validate import validate
from launcher.executors.base import StagePlan, StageResult
from launcher.pipeline import drive
from launcher.rundir import RunDirectory, write_manifest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NANO = os.path.join(ROOT, "examples/nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16/megatron_lm_ptq.yaml")


def test_parse_and_refusals():
    assert hold.parse("export:end:/tmp/a:b") == ("export", "end", "/tmp/a:b")
    for bad in ("export:end", "export::/x", "export:middle:/x"):
        with pytest.raises(ValueError, match="PTQ_TEST_HOLD"):
            hold.parse(bad)


def test_off_by_default_and_only_at_the_named_stage_and_point(tmp_path):
    release = str(tmp_path / "go")
    assert hold.at("export", "end", 0, environ={}) is False
    for stage, point in (("export", "start"), ("mmlu", "end")):
        assert hold.at(stage, point, 0, environ={hold.ENV: f"export:end:{release}"}) is False
    assert not os.listdir(tmp_path)


def test_holds_until_released_and_marks_each_rank(tmp_path):
    release = str(tmp_path / "go")
    env = {hold.ENV: f"export:end:{release}"}
    done = {}
    threads = [threading.Thread(target=lambda r=r: done.setdefault(r, hold.at("export", "end", r, environ=env)))
               for r in range(2)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while not all(os.path.exists(hold.marker(release, r)) for r in range(2)):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    time.sleep(0.3)
    assert done == {}   # both held
    open(release, "w").close()
    for t in threads:
        t.join(10)
    assert done == {0: True, 1: True}


def test_a_hold_never_released_fails_after_its_timeout(tmp_path):
    env = {hold.ENV: f"quantize:start:{tmp_path / 'never'}", hold.TIMEOUT_ENV: "0.3"}
    with pytest.raises(hold.HoldTimeout, match="quantize:start not released"):
        hold.at("quantize", "start", 3, environ=env)
    assert os.path.exists(hold.marker(str(tmp_path / "never"), 3))


def test_a_config_may_not_set_the_hook():
    cfg = compose_example(NANO, ["+env.PTQ_TEST_HOLD=export:end:/tmp/x"])
    with pytest.raises(ConfigError,
                       match="env.PTQ_TEST_HOLD='export:end:/tmp/x': PTQ_TEST_\\* variables are test hooks"):
        validate(cfg, check_paths=False)


def test_the_local_executor_passes_the_hook_to_its_ranks(tmp_path, monkeypatch):
    """launch's environment reaches the ranks (Slurm: sbatch --export=ALL; here: the local agent)."""
    from launcher.executors.local import LocalExecutor

    release = str(tmp_path / "go")
    monkeypatch.setenv(hold.ENV, f"quantize:start:{release}")
    path = tmp_path / "run"
    path.mkdir()
    run = RunDirectory(str(path))
    run.write_metadata({"run_id": "run", "status": "pending", "stages": {"quantize": {"status": "pending"}}})
    code = "import os; from launcher import hold; hold.at('quantize', 'start', int(os.environ['RANK']))"
    plans = [StagePlan(name="quantize", world_size=2, argv=[sys.executable, "-c", code],
                       log_path=run.layout.log("quantize"))]
    ex = LocalExecutor(OmegaConf.create({"master_port": None, "omp_num_threads": 1}), run.path, echo=False)
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("code", drive(ex, run, plans)))
    t.start()
    deadline = time.monotonic() + 120
    while not all(os.path.exists(hold.marker(release, r)) for r in range(2)):
        assert time.monotonic() < deadline, open(run.layout.log("quantize")).read()
        time.sleep(0.05)
    assert t.is_alive()
    open(release, "w").close()
    t.join(120)
    assert result == {"code": 0} and run.metadata()["stages"]["quantize"]["status"] == "completed"


class _Reports:
    """An executor that reports what Slurm said, without running anything."""
    chains_failures, detached = True, False

    def __init__(self, results):
        self.results = results

    def run(self, plans, progress, preflight_only=False, detach=False):
        yield from self.results

    def cancel(self):
        pass


def test_node_fail_after_the_manifest_keeps_the_outputs_and_slurms_word(tmp_path, capsys):
    cfg = compose_example(NANO, [f"runs_root={tmp_path}"])
    run = RunDirectory.create(cfg, run_id="r1")
    write_manifest(run.path, cfg, "export")   # rank 0 got that far
    plans = [StagePlan(name=s, world_size=1, argv=["true"]) for s in ("mmlu", "export")]
    code = drive(_Reports([StageResult("mmlu", "NODE_FAIL", 1, reason="Slurm state NODE_FAIL"),
                           StageResult("export", "NODE_FAIL", 1, reason="Slurm state NODE_FAIL")]), run, plans)
    assert code != 0
    st = run.metadata()["stages"]
    assert st["export"]["status"] == "node_fail" and st["export"]["outputs"].startswith("complete (manifest written)")
    assert st["mmlu"]["status"] == "node_fail" and "outputs" not in st["mmlu"]   # no manifest: nothing kept
    out = capsys.readouterr().out
    assert ("[launch] export: NODE_FAIL after the stage's work had completed: outputs kept (manifest written); "
            "--resume re-verifies them") in out
    assert "[launch] mmlu: NODE_FAIL after" not in out
