"""`launch suite`'s orchestration (launcher/suite.py) with an injected runner: torch-free, in seconds.

The suite starts every example through ``subprocess.run`` (launcher.suite's); here that is a
`Runner` that records each command and answers it: a ``--dry-run --json`` goes to the real CLI
in-process (no torch), and a real run leaves what ``launch`` would: a run directory under the
suite's runs root whose stages ended as the test says, and its exit code.  So the JUnit XML, the
Markdown summary, the skips and the suite's exit code are asserted exactly, without ranks.
tests/test_suite.py runs the same suite for real on the tiny example (slow).

The machine is fixed: no GPU, an empty build cache ($PTQ_CACHE_DIR), so every example but the
tiny Qwen3-MoE is "not on this machine"; the tiny one is made runnable (its checks of the built
model's files are tests/test_suite.py's and test_examples_resolve's).
"""
import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
from xml.etree import ElementTree as ET

import pytest

from conftest import ROOT

REAL_RUN = subprocess.run

from launcher import cli, suite
from launcher.config.compose import compose_example
from launcher.contract import RunLayout
from launcher.rundir import RunDirectory

TINY = "examples/tiny/Qwen3-MoE-tiny/megatron_lm_ptq.yaml"
NEMOTRON_TINY = "examples/tiny/NemotronH-MoE-tiny/megatron_lm_ptq.yaml"
SMOLLM2 = "examples/HuggingFaceTB/SmolLM2-135M-Instruct/megatron_lm_ptq.yaml"
LLAMA = "examples/meta-llama/Llama-3.2-1B-Instruct/megatron_lm_ptq.yaml"
QWEN30B = "examples/Qwen/Qwen3-30B-A3B/megatron_lm_ptq.yaml"
NANO = "examples/nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16/megatron_lm_ptq.yaml"
SUPER = "examples/nvidia/NVIDIA-Nemotron-3-Super-120B-A12B-BF16/megatron_lm_ptq.yaml"
NOT_HERE = "dry_run: checkpoint not on this machine (/hf-local/"
GATE_REASON = "MMLU accuracy 0.8750 below the lower bound 0.99"

# a failed gate as `launch` records it: quantize and export done (allow_to_fail lets later stages run)
GATE_FAILED = {"quantize": {"status": "completed", "duration_s": 30.0},
               "mmlu": {"status": "failed", "duration_s": 20.0, "exit_code": 3, "reason": GATE_REASON},
               "export": {"status": "completed", "duration_s": 10.0}}
ALL_PASSED = {"quantize": {"status": "completed", "duration_s": 30.0},
              "mmlu": {"status": "completed", "duration_s": 20.0},
              "export": {"status": "completed", "duration_s": 10.0}}


class Runner:
    """Stands in for ``subprocess.run`` as launcher.suite calls it (``cmd`` is
    ``[python, -m, launcher.cli, EXAMPLE, *overrides]``); any other command runs for real."""

    def __init__(self, stages=None, returncode=0, accuracy=0.875, dry_run_fails=()):
        self.stages, self.returncode, self.accuracy = stages or {}, returncode, accuracy
        self.dry_run_fails = set(dry_run_fails)
        self.calls = []

    def __call__(self, cmd, *args, **kw):
        if list(cmd[:3]) != [sys.executable, "-m", "launcher.cli"]:   # not the suite's (e.g. git, for the history)
            return REAL_RUN(cmd, *args, **kw)
        self.calls.append(list(cmd))
        argv = list(cmd[3:])
        if "--dry-run" in argv:
            if argv[0] in self.dry_run_fails:
                return subprocess.CompletedProcess(cmd, 2, "", "launch: stages.export: refused by this test\n")
            out, err = io.StringIO(), io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                code = cli.main(argv)
            return subprocess.CompletedProcess(cmd, code, out.getvalue(), err.getvalue())
        cfg = compose_example(argv[0], argv[1:])
        run = RunDirectory.create(cfg, run_id="20261205-000000-fake")
        for name, fields in self.stages.items():
            run.update_stage(name, **fields)
        run.update_run(status="completed" if self.returncode == 0 else "failed")
        bound = cfg.stages.mmlu.lower_bound
        os.makedirs(os.path.dirname(run.layout.mmlu_results), exist_ok=True)
        with open(run.layout.mmlu_results, "w") as f:
            json.dump({"accuracy": self.accuracy, "lower_bound": bound, "pass": self.accuracy >= bound}, f)
        return subprocess.CompletedProcess(cmd, self.returncode)


class Clock:
    """launcher.suite's `time`: each reading 2.5 s after the last, so every duration is 2.5 s."""

    def __init__(self):
        self.now = 1000.0

    def time(self):
        self.now += 2.5
        return self.now

    strftime = staticmethod(__import__("time").strftime)


@pytest.fixture
def machine(tmp_path, monkeypatch):
    """This test's machine: cwd the repository, no GPU, an empty build cache, the tiny Qwen3-MoE
    runnable; returns a function installing a Runner."""
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("PTQ_CACHE_DIR", str(tmp_path / "empty-cache"))
    monkeypatch.setattr(suite, "gpu_count", lambda: 0)
    monkeypatch.setattr(suite, "time", Clock())
    real = suite.why_not_runnable
    monkeypatch.setattr(suite, "why_not_runnable",
                        lambda cfg, gpus: None if cfg.model.name == "Qwen3-MoE-tiny" else real(cfg, gpus))

    def install(runner):
        monkeypatch.setattr(suite.subprocess, "run", runner)
        return runner
    return install


def junit_cases(path):
    """(root attributes, {case name: (time, child tag or None, child attributes, child text)})."""
    root = ET.parse(path).getroot()
    cases = {}
    for c in root.iter("testcase"):
        assert c.get("classname") == "examples"
        kids = list(c)
        assert len(kids) <= 1, ET.tostring(c)
        k = kids[0] if kids else None
        cases[c.get("name")] = (c.get("time"), k.tag if k is not None else None,
                                dict(k.attrib) if k is not None else {}, k.text if k is not None else None)
    return dict(root.attrib), cases


def not_here(cfg_path):
    return f"{NOT_HERE}{compose_example(cfg_path).model.path.split('/hf-local/', 1)[1]})"


def test_allowed_failure_junit_summary_and_skips(tmp_path, machine):
    """As tests/test_suite.py runs it: level 3, every example overridden, the tiny one's gate fails
    but it is allowed to fail; the rest are dry-run (not here), skipped (level) or excluded."""
    runner = machine(Runner(GATE_FAILED, returncode=3))
    junit, runs = tmp_path / "out.xml", tmp_path / "runs"
    overrides = ["allow_to_fail=true", "stages.mmlu.lower_bound=0.99", "stages.vllm_smoke.enabled=false"]
    code = suite.run_suite("examples/", test_level=3, junit=str(junit), overrides=overrides + [f"runs_root={runs}"],
                           exclude=["examples/tiny/NemotronH-MoE-tiny/*"])
    assert code == 0

    # what was started: one real run (the tiny one), a dry run of each example not on this machine
    real = [c for c in runner.calls if "--dry-run" not in c]
    assert real == [[sys.executable, "-m", "launcher.cli", TINY, *overrides, f"runs_root={runs}"]]
    assert sorted(c[3] for c in runner.calls if "--dry-run" in c) == sorted([LLAMA, QWEN30B, NANO, SUPER])

    attrs, cases = junit_cases(junit)
    assert attrs == {"name": "ptq-examples", "tests": "7", "failures": "0", "errors": "0", "skipped": "6"}
    assert cases == {
        SMOLLM2: ("0.0", "skipped", {"message": "skipped: test_level 4 > 3"}, None),
        LLAMA: ("2.5", "skipped", {"message": not_here(LLAMA)}, None),
        QWEN30B: ("2.5", "skipped", {"message": not_here(QWEN30B)}, None),
        NANO: ("2.5", "skipped", {"message": not_here(NANO)}, None),
        SUPER: ("2.5", "skipped", {"message": not_here(SUPER)}, None),
        NEMOTRON_TINY: ("0.0", "skipped", {"message": "skipped: excluded by --exclude examples/tiny/NemotronH-MoE-tiny/*"},
                        None),
        TINY: ("2.5", "system-out", {}, f"allowed to fail: exit 3 in mmlu: {GATE_REASON}"),
    }

    md = (tmp_path / "out.md").read_text()   # the summary beside the JUnit file
    tiny_rows = [line for line in md.splitlines() if line.startswith(f"| {TINY} |")]
    assert tiny_rows == [
        f"| {TINY} | (all) | allowed_failure |  |  | 2.5 | exit 3 in mmlu: {GATE_REASON} |",
        f"| {TINY} | quantize | completed |  |  | 30.0 |  |",
        f"| {TINY} | mmlu | failed | 0.8750 | 0.99 | 20.0 | {GATE_REASON} |",
        f"| {TINY} | export | completed |  |  | 10.0 |  |",
        f"| {TINY} | vllm_smoke | disabled |  |  |  |  |",
    ]
    nano_rows = [line for line in md.splitlines() if line.startswith(f"| {NANO} |")]
    assert nano_rows == [f"| {NANO} | (all) | dry_run |  |  | 2.5 | {not_here(NANO)[len('dry_run: '):]} |",
                         *(f"| {NANO} | {s} | planned |  |  |  |  |" for s in ("quantize", "mmlu", "export")),
                         f"| {NANO} | vllm_smoke | disabled |  |  |  |  |"]
    assert md.splitlines()[:2] == ["| example | stage | status | accuracy | bound | duration (s) | note |",
                                   "|---|---|---|---|---|---|---|"]
    assert len(md.splitlines()) == 2 + 7 + 5 * 4   # 7 examples; the run and the 4 dry runs list their 4 stages

    # the run is in the suite's history, for `launch report`
    with open(runs / "history.jsonl") as f:
        records = [json.loads(line) for line in f]
    assert [(r["example"], r["run_id"]) for r in records] == [(TINY, "20261205-000000-fake")]


def test_failure_not_allowed_fails_the_suite(tmp_path, machine):
    machine(Runner(GATE_FAILED, returncode=3))
    junit = tmp_path / "out.xml"
    code = suite.run_suite("examples/", test_level=0, junit=str(junit), summary=str(tmp_path / "summary.md"),
                           overrides=["stages.mmlu.lower_bound=0.99", "stages.vllm_smoke.enabled=false"], runs_root=str(tmp_path / "runs"),
                           exclude=[NEMOTRON_TINY])
    assert code == 1
    attrs, cases = junit_cases(junit)
    assert attrs == {"name": "ptq-examples", "tests": "7", "failures": "1", "errors": "0", "skipped": "6"}
    time_s, tag, attrib, text = cases[TINY]
    assert (time_s, tag, attrib) == ("2.5", "failure", {"message": f"exit 3 in mmlu: {GATE_REASON}"})
    assert json.loads(text) == [
        {"name": "quantize", "status": "completed", "duration_s": 30.0, "reason": ""},
        {"name": "mmlu", "status": "failed", "duration_s": 20.0, "reason": GATE_REASON, "accuracy": 0.875,
         "bound": 0.99},
        {"name": "export", "status": "completed", "duration_s": 10.0, "reason": ""},
        {"name": "vllm_smoke", "status": "disabled", "duration_s": None, "reason": ""},
    ]
    assert not (tmp_path / "out.md").exists()   # --summary names the Markdown's file
    assert f"| {TINY} | (all) | failed |  |  | 2.5 | exit 3 in mmlu: {GATE_REASON} |" in (
        tmp_path / "summary.md").read_text().splitlines()


def test_level_skips_start_nothing_and_a_pass_has_no_note(tmp_path, machine):
    """At level 0 every example above it is skipped without being started, not even dry-run; a
    passing run is a bare test case."""
    runner = machine(Runner(ALL_PASSED, returncode=0, accuracy=0.9))
    junit = tmp_path / "out.xml"
    code = suite.run_suite("examples/", test_level=0, junit=str(junit), runs_root=str(tmp_path / "runs"),
                           exclude=[NEMOTRON_TINY])
    assert code == 0
    assert [c[3] for c in runner.calls] == [TINY]
    attrs, cases = junit_cases(junit)
    assert attrs == {"name": "ptq-examples", "tests": "7", "failures": "0", "errors": "0", "skipped": "6"}
    assert cases[TINY] == ("2.5", None, {}, None)
    levels = {SMOLLM2: 4, LLAMA: 1, QWEN30B: 2, NANO: 2, SUPER: 3}
    for path, level in levels.items():
        assert cases[path] == ("0.0", "skipped", {"message": f"skipped: test_level {level} > 0"}, None), path
    assert cases[NEMOTRON_TINY] == ("0.0", "skipped", {"message": f"skipped: excluded by --exclude {NEMOTRON_TINY}"},
                                    None)
    md = (tmp_path / "out.md").read_text().splitlines()
    assert f"| {TINY} | (all) | passed |  |  | 2.5 |  |" in md
    assert f"| {TINY} | mmlu | completed | 0.9000 | 0.85 | 20.0 |  |" in md


def test_invalid_examples_are_errors(tmp_path, machine):
    """An example that does not validate, and one whose dry run fails, are JUnit errors that fail
    the suite; the others still run."""
    runner = machine(Runner(ALL_PASSED, returncode=0))
    examples = tmp_path / "examples"
    (examples / "bad").mkdir(parents=True)
    (examples / "refused").mkdir()
    (examples / "tiny").mkdir()
    shutil.copy(os.path.join(ROOT, TINY), examples / "tiny" / "megatron_lm_ptq.yaml")
    with open(os.path.join(ROOT, TINY)) as f:
        text = f.read()
    (examples / "bad" / "megatron_lm_ptq.yaml").write_text(
        text.replace("job_name: tiny-qwen3-moe-nvfp4", "job_name: bad\nnot_a_key: 1"))
    # a big model's example (dry-run here): its dry run is the one refused
    with open(os.path.join(ROOT, QWEN30B)) as f:
        (examples / "refused" / "megatron_lm_ptq.yaml").write_text(f.read())
    refused = str(examples / "refused" / "megatron_lm_ptq.yaml")
    runner.dry_run_fails = {refused}
    junit = tmp_path / "out.xml"
    code = suite.run_suite(str(examples), test_level=3, junit=str(junit), runs_root=str(tmp_path / "runs"))
    assert code == 1
    attrs, cases = junit_cases(junit)
    assert attrs == {"name": "ptq-examples", "tests": "3", "failures": "0", "errors": "2", "skipped": "0"}
    rel = {name.rsplit("/", 2)[-2]: v for name, v in cases.items()}
    assert set(rel) == {"bad", "refused", "tiny"}
    time_s, tag, attrib, text = rel["bad"]
    assert (time_s, tag) == ("0.0", "error") and "not_a_key" in text and attrib["message"] == text[:200]
    assert rel["refused"] == ("2.5", "error", {"message": "launch: stages.export: refused by this test"},
                              "launch: stages.export: refused by this test")
    assert rel["tiny"] == ("2.5", None, {}, None)
    assert [c[3] for c in runner.calls] == [refused, str(examples / "tiny" / "megatron_lm_ptq.yaml")]
