"""The tiny pipeline through Slurm, shared by the single-node and the two-node tests.

``tiny_single_node_run``: one `launch` of the tiny example on the single-node cluster, run once per
session whichever module asks first (test_slurm_pipeline.py checks it; test_slurm_multinode.py
compares the two-node run's outputs with it).  ``tiny_single_node_started`` starts that `launch`
in the background without waiting for it: test_slurm_executor.py asks for it, so the run's minute of
work overlaps that module's idle minute (its TIMEOUT job waits for Slurm's time limit) instead of
adding to the two-node test; it is started only when a selected test will wait for it, and a run
nobody waited for is stopped at the session's end.  ``Launch``: `launch` as a subprocess whose console
is read line by line with timestamps, so a test can wait for a line, inject a fault and measure
how long the failure takes to be reported.  ``compare_outputs``: what must be equal between two
runs of the same config - predictions, the gate's numbers, the quantize summary, export tensors.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pytest

from conftest import ROOT, TINY_EXAMPLE

try:
    from slurm_cluster import slurm_cluster  # noqa: F401
except ImportError:  # pragma: no cover
    from tests.slurm_cluster import slurm_cluster  # noqa: F401


class Launch:
    """`python -m launcher.cli TINY_EXAMPLE *args` with ``env``; console lines kept with their times."""

    def __init__(self, args: list[str], env: dict[str, str], echo: bool = True):
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen([sys.executable, "-m", "launcher.cli", TINY_EXAMPLE, *args], cwd=ROOT,
                                     env={**env, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        self.lines: list[tuple[float, str]] = []
        self.t_eof: Optional[float] = None     # when the console closed (the process is ending)
        self._cond = threading.Condition()
        self._echo = echo
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self._cond:
                self.lines.append((time.monotonic(), line.rstrip("\n")))
                self._cond.notify_all()
            if self._echo and line.startswith("[launch]"):
                print(f"    {time.monotonic() - self.t0:7.1f}s {line.rstrip()}", flush=True)
        with self._cond:
            self.t_eof = time.monotonic()
            self._cond.notify_all()

    @property
    def output(self) -> str:
        return "\n".join(line for _, line in self.lines)

    def wait_for(self, pattern: str, timeout_s: float = 900) -> tuple[float, re.Match]:
        """The first console line matching ``pattern``: (its time, the match); fails on exit or timeout."""
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout_s
        seen = 0
        with self._cond:
            while True:
                for t, line in self.lines[seen:]:
                    m = rx.search(line)
                    if m:
                        return t, m
                seen = len(self.lines)
                if self.proc.poll() is not None and not self._reader.is_alive():
                    raise AssertionError(f"launch exited ({self.proc.returncode}) before a line matched "
                                         f"{pattern!r}:\n{self.output[-4000:]}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"no console line matched {pattern!r} in {timeout_s:.0f} s:\n"
                                         f"{self.output[-4000:]}")
                self._cond.wait(min(left, 1.0))

    def run_dir(self) -> str:
        return self.wait_for(r"^\[launch\] run directory: (.+)$", 120)[1].group(1).strip()

    def finish(self, timeout_s: float = 1500) -> tuple[int, float]:
        """(exit code, time it exited)."""
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"launch still running after {timeout_s:.0f} s:\n{self.output[-4000:]}")
        t = time.monotonic()
        self._reader.join(timeout=30)
        return self.proc.returncode, t


@dataclass
class TinyRun:
    rc: int
    output: str
    run_dir: str
    wall_s: float


_RUNS: dict[str, TinyRun] = {}
_STARTED: dict[str, tuple[Launch, Path]] = {}   # the started `launch` and its runs_root
# set by a test module that asks for tiny_single_node_run with request.getfixturevalue (not by name)
USES_SINGLE_NODE_RUN = "USES_TINY_SINGLE_NODE_RUN"


def _start_single_node_run(cluster, tmp_path_factory) -> tuple[Launch, Path]:
    if "single" not in _STARTED:
        runs = tmp_path_factory.mktemp("tiny-slurm-1node")
        launch = Launch([*cluster.launch_overrides(), f"runs_root={runs}"], cluster.env, echo=False)
        _STARTED["single"] = (launch, runs)
    return _STARTED["single"]


def session_waits_for_single_node_run(items) -> bool:
    """Whether a selected test will wait for the single-node run (by name, or as a module that sets
    ``USES_TINY_SINGLE_NODE_RUN`` asks for it)."""
    return any("tiny_single_node_run" in getattr(item, "fixturenames", ())
               or getattr(getattr(item, "module", None), USES_SINGLE_NODE_RUN, False) for item in items)


@pytest.fixture(scope="session")
def tiny_single_node_started(request, slurm_cluster, tiny_dir, tmp_path_factory):  # noqa: F811
    """Starts the single-node run in the background (when a selected test will wait for it); at the
    session's end a run that nobody waited for is stopped (the cluster then cancels its jobs)."""
    if session_waits_for_single_node_run(request.session.items):
        _start_single_node_run(slurm_cluster, tmp_path_factory)
    yield
    launch = _STARTED.get("single", (None, None))[0]
    if launch is not None and "single" not in _RUNS and launch.proc.poll() is None:
        launch.proc.terminate()
        try:
            launch.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            launch.proc.kill()
            launch.proc.wait(timeout=30)


@pytest.fixture(scope="session")
def tiny_single_node_run(slurm_cluster, tiny_dir, tmp_path_factory) -> TinyRun:  # noqa: F811
    """The tiny example through the single-node cluster (4 tasks on one node), once per session;
    started here unless ``tiny_single_node_started`` started it earlier."""
    if "single" not in _RUNS:
        launch, runs = _start_single_node_run(slurm_cluster, tmp_path_factory)
        rc, t_end = launch.finish()
        job_dir = runs / "tiny-qwen3-moe-nvfp4"
        dirs = sorted(job_dir.iterdir()) if job_dir.is_dir() else []
        wall = min(t_end, launch.t_eof or t_end) - launch.t0
        _RUNS["single"] = TinyRun(rc, launch.output, str(dirs[0]) if len(dirs) == 1 else "", wall)
        print(f"\n[tiny single-node Slurm run] {_RUNS['single'].wall_s:.0f} s, exit {rc}", flush=True)
    return _RUNS["single"]


def read_json(path: str) -> Optional[dict]:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


# run-specific values in the outputs: how long things took, when, and the run's own paths
_VOLATILE = {"timings", "seconds", "duration_s", "finished", "export_dir", "loaded_from"}


def _strip(obj):
    if isinstance(obj, dict):
        return {k: _strip(v) for k, v in obj.items() if k not in _VOLATILE}
    if isinstance(obj, list):
        return [_strip(v) for v in obj]
    return obj


def _differing_tensors(a: str, b: str) -> list[str]:
    """Names of the tensors whose dtype, shape or bytes differ between two safetensors files."""
    import torch
    from safetensors import safe_open

    with safe_open(a, framework="pt") as fa, safe_open(b, framework="pt") as fb:
        names = sorted(set(fa.keys()) | set(fb.keys()))
        out = []
        for n in names:
            if n not in fa.keys() or n not in fb.keys():
                out.append(n)
                continue
            ta, tb = fa.get_tensor(n), fb.get_tensor(n)
            if ta.dtype != tb.dtype or ta.shape != tb.shape or not torch.equal(
                    ta.contiguous().view(-1).view(torch.uint8), tb.contiguous().view(-1).view(torch.uint8)):
                out.append(n)
        return out


def compare_outputs(ref_dir: str, run_dir: str, export_name: str) -> dict:
    """Assert that two runs of the tiny example produced the same outputs, bit for bit: the quantize
    summary, every MMLU prediction and logit and the gate's numbers, the export's verification,
    every file of the export (tensors named when a safetensors file differs), and the manifests'
    config hashes.  Only timings and the runs' own paths may differ.  Returns what was compared."""
    for rel in ("quantize/summary.json", "mmlu/results.json", "export/verify.json"):
        ref, got = read_json(os.path.join(ref_dir, rel)), read_json(os.path.join(run_dir, rel))
        assert ref is not None and got is not None, rel
        assert _strip(got) == _strip(ref), rel
    for stage in ("quantize", "mmlu", "export"):
        ref, got = (read_json(os.path.join(d, stage, "manifest.json")) for d in (ref_dir, run_dir))
        assert got["stage_config_hash"] == ref["stage_config_hash"], stage
    ref_e, got_e = os.path.join(ref_dir, "export", export_name), os.path.join(run_dir, "export", export_name)
    files = sorted(os.listdir(ref_e))
    assert sorted(os.listdir(got_e)) == files
    size = 0
    for name in files:
        with open(os.path.join(ref_e, name), "rb") as f:
            ref_bytes = f.read()
        with open(os.path.join(got_e, name), "rb") as f:
            same = f.read() == ref_bytes
        size += len(ref_bytes)
        if not same and name.endswith(".safetensors"):
            bad = _differing_tensors(os.path.join(ref_e, name), os.path.join(got_e, name))
            raise AssertionError(f"{name}: {len(bad)} tensors differ, e.g. {bad[:5]}")
        assert same, f"export file {name} differs"
    questions = read_json(os.path.join(ref_dir, "mmlu", "results.json"))["questions"]
    return {"questions": len(questions), "export_files": len(files), "export_bytes": size}
