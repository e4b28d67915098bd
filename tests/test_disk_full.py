"""A run directory whose file system fills up (as the H200's 64 GiB disk did under the Nano-width
benchmark, 2026-12-06): launch stops the stage, says so with the free space and the way on, exits 1
without a traceback and leaves no temporary files; a new run on a full disk is refused, exit 2.

On a real tmpfs of 64 KiB (mounting needs root: CI runs as root on this machine; elsewhere these
tests skip, saying why).  The stand-in stage is a plain Python process, as in test_pipeline_drive.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from omegaconf import OmegaConf

from launcher.contract import ExitCode, StageStatus
from launcher.executors.base import StagePlan
from launcher.pipeline import drive
from launcher.rundir import RunDirectory

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = [pytest.mark.timeout(120)]


@pytest.fixture
def small_fs(tmp_path):
    mnt = tmp_path / "small-fs"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], capture_output=True, text=True)
    if p.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {p.stderr.strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:      # a zombie is not running
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _gone_within(pid: int, seconds: float) -> bool:
    """The stand-in rank runs under the local agent (torch elastic), which stops it on the agent's SIGTERM."""
    deadline = time.monotonic() + seconds
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    return not _alive(pid)


@pytest.mark.slow        # the local agent's start and its stop of the rank: about 16 s, out of make test-fast
def test_a_stage_that_fills_the_disk_is_stopped_and_said_so(small_fs, tmp_path, capsys):
    from launcher.executors.local import LocalExecutor

    run = RunDirectory(str(small_fs / "run"))
    os.makedirs(run.path)
    run.write_metadata({"run_id": "run", "status": "pending",
                        "stages": {s: {"status": "pending"} for s in ("quantize", "mmlu")}})
    pid_file = tmp_path / "stage.pid"                # outside the full file system
    endless = (f"import os; open({str(pid_file)!r}, 'w').write(str(os.getpid()))\n"
               "while True: print('x' * 1000, flush=True)")
    plans = [StagePlan(name=s, world_size=1, argv=[sys.executable, "-c", endless], log_path=run.layout.log(s))
             for s in ("quantize", "mmlu")]
    cfg = OmegaConf.create({"master_port": None, "omp_num_threads": 1})

    assert drive(LocalExecutor(cfg, run.path, echo=False), run, plans) == ExitCode.FAILED

    out = capsys.readouterr().out
    assert "[launch] quantize: no space left on the device: [Errno 28] No space left on device" in out, out
    assert (f"[launch] {run.path}: 0.00 GB free on its file system; free space there, then "
            f"`launch <config> --resume {run.path}` (completed stages are kept)") in out, out
    assert "[launch] metadata.json could not be updated either ([Errno 28] No space left on device): it may " \
           "still say quantize is running" in out, out
    assert "mmlu: running" not in out                 # the next stage is not started
    assert _gone_within(int(pid_file.read_text()), 30)   # the stage's rank was stopped
    # metadata.json is the last complete write (quantize running), and no temporary file is left
    meta = json.loads((small_fs / "run" / "metadata.json").read_text())
    assert meta["stages"]["quantize"]["status"] == StageStatus.RUNNING and meta["stages"]["mmlu"]["status"] == "pending"
    leftovers = [os.path.join(d, f) for d, _, files in os.walk(small_fs) for f in files if ".tmp-" in f]
    assert leftovers == []


def test_a_new_run_on_a_full_disk_is_refused(small_fs):
    with open(small_fs / "filler", "wb", buffering=0) as f:   # every byte of the file system
        with pytest.raises(OSError):
            while True:
                f.write(b"\0" * 4096)
    p = subprocess.run([sys.executable, "-m", "launcher.cli", "examples/tiny/Qwen3-MoE-tiny/megatron_lm_ptq.yaml",
                        f"runs_root={small_fs}/runs"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == ExitCode.USAGE, p.stdout + p.stderr
    assert p.stderr.startswith(f"launch: runs_root={small_fs}/runs: the run directory could not be written, no "
                               "space left on the device ([Errno 28] No space left on device"), p.stderr
    assert "Traceback" not in p.stderr
