"""`launch suite examples/`: runs the tiny example on this CPU machine, dry-runs the rest (saying
why), writes JUnit XML and a Markdown summary; an allow_to_fail failure does not fail the suite.

The suite runs in this process (`launch suite` through launcher.cli.main), its subprocesses for
real; the tiny example's `launch` resumes a copy of the session's completed tiny run
(tests/shared_runs.py) without its export: its quantize is skipped (the manifest matches), the gate
and export run.
tests/test_suite_orchestration.py asserts the suite's JUnit, summary and skips exactly, torch-free.
"""
import json
import os
import shutil
import subprocess
from xml.etree import ElementTree as ET

import pytest

from conftest import ROOT

pytestmark = pytest.mark.slow

TINY = "examples/tiny/Qwen3-MoE-tiny/megatron_lm_ptq.yaml"


def test_suite_runs_tiny_and_dry_runs_the_rest(tmp_path, tiny_run, monkeypatch):
    from launcher import cli, suite

    runs = tmp_path / "runs"
    seeded = tiny_run.copy_completed(runs)   # <runs>/<job>/<run id>: the run the suite then reads
    # the copy is this test's: its export is removed, so the suite's run exports anew after the gate
    # (as a fresh run would; an existing export/hf is refused without stages.export.overwrite=true)
    shutil.rmtree(seeded / "export")
    real_run = subprocess.run
    started = []

    def runner(cmd, *args, **kw):
        """launcher.suite's subprocess.run: the tiny example's run resumes the copy."""
        if cmd[3:4] == [TINY] and "--dry-run" not in cmd:
            cmd = [*cmd, "--resume", str(seeded)]
        started.append(cmd)
        return real_run(cmd, *args, **kw)

    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setattr(suite.subprocess, "run", runner)
    junit = tmp_path / "out.xml"
    # every example gets these overrides; only the tiny one runs: its gate is made to fail, but the
    # job is allowed to fail, so later stages still run and the suite passes.
    code = cli.main(
        ["suite", "examples/", "--test-level", "3", "--junit", str(junit),
         "--exclude", "examples/tiny/NemotronH-MoE-tiny/*",   # runs in tests/test_pipeline_nemotron_h.py
         "allow_to_fail=true", "stages.mmlu.lower_bound=0.99", "stages.vllm_smoke.enabled=false",
         f"runs_root={runs}"])
    assert code == 0
    assert [c for c in started if "--resume" in c], started
    with open(seeded / "metadata.json") as f:   # the suite's run was the copy, its quantize not redone
        stages = json.load(f)["stages"]
    assert stages["quantize"]["status"] == "skipped", stages
    assert sorted(os.listdir(runs / seeded.parent.name)) == [seeded.name]
    cases = {c.get("name"): c for c in ET.parse(junit).getroot().iter("testcase")}
    tiny = cases["examples/tiny/Qwen3-MoE-tiny/megatron_lm_ptq.yaml"]
    assert "allowed to fail" in tiny.find("system-out").text and "mmlu" in tiny.find("system-out").text
    nano = cases["examples/nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16/megatron_lm_ptq.yaml"]
    skipped = nano.find("skipped")
    assert skipped is not None and "checkpoint not on this machine" in skipped.get("message")
    root = ET.parse(junit).getroot()
    assert (root.get("tests"), root.get("failures"), root.get("errors")) == ("7", "0", "0")
    excluded = cases["examples/tiny/NemotronH-MoE-tiny/megatron_lm_ptq.yaml"].find("skipped")
    assert excluded.get("message") == "skipped: excluded by --exclude examples/tiny/NemotronH-MoE-tiny/*"
    md = (tmp_path / "out.md").read_text()
    assert "| examples/tiny/Qwen3-MoE-tiny/megatron_lm_ptq.yaml | mmlu | failed |" in md
    assert "| examples/tiny/Qwen3-MoE-tiny/megatron_lm_ptq.yaml | export | completed |" in md
    assert "0.99" in md  # the bound is reported next to the accuracy
