"""History records (launcher/report/records.py, history.py): a record per run directory, written by
the product's own writers (tests/report_runs.py); interrupted and broken runs give well-formed
records; appending is atomic; the history is rebuilt from run directories; `launch report`'s usage
errors are one line and exit 2."""
import json
import multiprocessing
import os
import subprocess
import sys

import pytest

from launcher.mmlu.gate import wilson_interval
from launcher.mmlu.paired import clopper_pearson
from launcher.report import history
from launcher.report.records import INTERRUPTED, is_failure, record_from_run_dir
from report_runs import ROOT, make_run


def test_record_of_a_passing_run(tmp_path):
    run = make_run(str(tmp_path), "20261101-010000-aaaa", "2026-11-01T01:00:00", baseline_correct=310, n10=4, n01=1)
    rec = record_from_run_dir(run, example="examples/tiny/x.yaml", commit="abc123")
    json.loads(json.dumps(rec))                       # plain JSON
    assert (rec["run_id"], rec["job_name"], rec["status"], rec["recipe"]) == (
        "20261101-010000-aaaa", "tiny-qwen3-moe-nvfp4", "completed", "nvfp4_default")
    assert (rec["example"], rec["commit"], rec["created"]) == ("examples/tiny/x.yaml", "abc123", "2026-11-01T01:00:00")
    g = rec["gate"]
    assert g["accuracy"] == pytest.approx(307 / 320) and g["pass"] is True
    assert g["interval"] == pytest.approx(list(wilson_interval(307, 320)))
    assert (g["lower_bound"], g["max_drop"], g["baseline_mode"]) == (0.85, 0.05, "evaluate")
    assert g["baseline_accuracy"] == pytest.approx(310 / 320) and g["drop"] == pytest.approx(3 / 320)
    lo, hi = clopper_pearson(4, 5)
    assert g["drop_interval"] == pytest.approx([(2 * lo - 1) * 5 / 320, (2 * hi - 1) * 5 / 320])
    assert g["drop_method"] == "mcnemar_exact" and g["mean_kl"] > 0 and g["agreement"] == pytest.approx(315 / 320)
    assert rec["export"]["ok"] is True and rec["export"]["size_ratio"] == 0.36
    assert rec["vllm_smoke"]["skipped"].startswith("NVFP4 needs a Blackwell GPU")
    assert {s: st["duration_s"] for s, st in rec["stages"].items()} == {
        "quantize": 60.0, "mmlu": 45.0, "export": 30.0, "vllm_smoke": 5.0}
    assert rec["errors"] == [] and not is_failure(rec)
    assert rec["versions"]["python"]


def test_record_of_a_failed_gate_names_its_error_lines_once(tmp_path):
    run = make_run(str(tmp_path), "r-fail", "2026-11-02T01:00:00", lower_bound=0.99)
    rec = record_from_run_dir(run)
    assert rec["status"] == "failed" and rec["exit_code"] == 3 and rec["gate"]["pass"] is False
    assert rec["stages"]["export"]["status"] == "not_run" and rec["export"] is None
    assert rec["errors"][0] == "mmlu: failed - gate failed (accuracy below the bound)"
    # 4 ranks print the same STAGE FAILED line; results.json's failure says it again: one line
    assert rec["errors"][1:] == ["mmlu: STAGE FAILED: MMLU gate failed: accuracy 0.9594 (307/320) < lower_bound 0.99"]
    assert is_failure(rec)


def test_record_of_an_interrupted_run_is_well_formed(tmp_path):
    run = make_run(str(tmp_path), "r-int", "2026-11-03T01:00:00", interrupted_in="mmlu")
    rec = record_from_run_dir(run)
    again = json.loads(json.dumps(rec))
    assert again == rec
    assert rec["status"] == INTERRUPTED and rec["gate"] is None and rec["export"] is None and rec["ended"] is None
    assert rec["stages"]["quantize"] == {"status": "completed", "duration_s": 60.0, "exit_code": 0}
    assert rec["stages"]["mmlu"]["status"] == "running" and rec["stages"]["mmlu"]["duration_s"] is None
    assert rec["stages"]["export"]["status"] == "pending"
    assert rec["errors"] == ["interrupted: mmlu was running when this record was made (the launcher crashed "
                             "or was killed, or is still running)"]
    assert is_failure(rec)


def test_broken_and_missing_files_are_recorded_not_raised(tmp_path):
    run = make_run(str(tmp_path), "r-broken", "2026-11-04T01:00:00")
    with open(os.path.join(run, "mmlu", "results.json"), "w") as f:
        f.write('{"accuracy": 0.9, "interv')                 # a torn file (not the product's writer)
    rec = record_from_run_dir(run)
    assert rec["gate"] is None and rec["errors"][0].startswith("mmlu/results.json unreadable: JSONDecodeError")
    empty = tmp_path / "job" / "r-nothing"
    empty.mkdir(parents=True)
    rec = record_from_run_dir(str(empty))
    assert (rec["status"], rec["run_id"], rec["job_name"]) == (INTERRUPTED, "r-nothing", "job")
    assert rec["errors"][0].startswith("metadata.json missing")


def test_append_is_whole_lines_and_a_torn_line_is_skipped(tmp_path):
    root = str(tmp_path)
    run = make_run(root, "r1", "2026-11-01T01:00:00")
    history.append_run(root, run, example="a.yaml")
    with open(history.history_path(root), "ab") as f:
        f.write(b'{"schema": 1, "run_id": "torn"')          # what a non-atomic writer could leave
    history.append_record(root, {"schema": 1, "run_id": "r2", "job_name": "j"})
    records, warnings = history.read_history(history.history_path(root))
    assert [r["run_id"] for r in records] == ["r1", "r2"] and records[0]["example"] == "a.yaml"
    assert warnings == [f"{history.history_path(root)} line 2: not a JSON record (skipped)"]


def test_a_crash_while_appending_leaves_the_old_history(tmp_path, monkeypatch):
    root = str(tmp_path)
    history.append_record(root, {"schema": 1, "run_id": "r1", "job_name": "j"})
    before = open(history.history_path(root), "rb").read()

    def crash(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(history.os, "replace", crash)
    with pytest.raises(OSError):
        history.append_record(root, {"schema": 1, "run_id": "r2", "job_name": "j"})
    assert open(history.history_path(root), "rb").read() == before


def _append_many(root: str, worker: int) -> None:
    for i in range(15):
        history.append_record(root, {"schema": 1, "run_id": f"w{worker}-{i}", "job_name": "j", "pad": "x" * 5000})


def test_concurrent_appends_lose_nothing(tmp_path):
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_append_many, args=(str(tmp_path), w)) for w in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    records, warnings = history.read_history(history.history_path(str(tmp_path)))
    assert not warnings and sorted(r["run_id"] for r in records) == sorted(
        f"w{w}-{i}" for w in range(3) for i in range(15))


def test_rebuild_keeps_gone_runs_and_what_only_the_history_knows(tmp_path):
    root = str(tmp_path)
    kept = make_run(root, "r-kept", "2026-11-01T01:00:00")
    gone = make_run(root, "r-gone", "2026-11-02T01:00:00")
    history.append_run(root, kept, example="examples/tiny/Qwen3-MoE-tiny/megatron_lm_ptq.yaml")
    history.append_run(root, gone)
    import shutil

    shutil.rmtree(gone)
    make_run(root, "r-new", "2026-11-03T01:00:00", interrupted_in="export")   # never appended (killed)
    path, records, warnings = history.rebuild_history(root)
    assert not warnings and [r["run_id"] for r in records] == ["r-kept", "r-gone", "r-new"]
    on_disk, _ = history.read_history(path)
    assert [r["run_id"] for r in on_disk] == ["r-kept", "r-gone", "r-new"]
    assert on_disk[0]["example"] == "examples/tiny/Qwen3-MoE-tiny/megatron_lm_ptq.yaml" and on_disk[0]["source"] == "rundir"
    assert on_disk[1]["source"] == "append" and on_disk[2]["status"] == INTERRUPTED


def test_suite_appends_one_record_per_run(tmp_path, monkeypatch):
    from launcher import suite

    root = str(tmp_path / "runs")

    def fake_launch(cmd, *a, **k):       # the subprocess `launch` would leave this run directory
        make_run(root, "20261105-010000-bbbb", "2026-11-05T01:00:00", lower_bound=0.99)
        return subprocess.CompletedProcess(cmd, 3)

    monkeypatch.setattr(suite, "why_not_runnable", lambda cfg, gpus: None)
    monkeypatch.setattr(suite.subprocess, "run", fake_launch)
    out = suite._one_example(os.path.join(ROOT, "examples/tiny/Qwen3-MoE-tiny/megatron_lm_ptq.yaml"), 0, 0, [], root)
    assert out.status == "failed"
    records, _ = history.read_history(history.history_path(root))
    assert len(records) == 1 and records[0]["status"] == "failed" and records[0]["source"] == "append"
    assert records[0]["example"].endswith("examples/tiny/Qwen3-MoE-tiny/megatron_lm_ptq.yaml")


def _launch(*args):
    return subprocess.run([sys.executable, "-m", "launcher.cli", *args], cwd=ROOT, capture_output=True, text=True)


def test_report_usage_errors_are_one_line_and_exit_2(tmp_path):
    proc = _launch("report", str(tmp_path / "nope"))
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0
    assert proc.stderr.startswith(f"launch: {tmp_path / 'nope'}: no such runs root")
    assert "no runs here" in _launch("report", str(tmp_path)).stderr
    make_run(str(tmp_path), "r1", "2026-11-01T01:00:00")
    proc = _launch("report", str(tmp_path), "--since", "yesterday")
    assert proc.returncode == 2 and "--since 'yesterday': expected a date" in proc.stderr
    proc = _launch("report", str(tmp_path), "--example", "nemotron*")
    assert proc.returncode == 2 and "1 run(s), none selected by example nemotron*" in proc.stderr
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    proc = _launch("report", str(tmp_path), "--out", str(tmp_path / "mine"))
    assert proc.returncode == 2 and "is not an earlier report" in proc.stderr
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


def test_launch_history_records_a_run_that_crashed_mid_way(tmp_path, monkeypatch, capsys):
    import launcher.pipeline as pipeline
    from launcher.cli import main
    from report_runs import TINY_EXAMPLE

    def crash(cfg, run, **kwargs):       # the launcher dies while quantize runs
        run.update_run(status="running")
        run.update_stage("quantize", status="running")
        raise RuntimeError("launcher crashed")

    monkeypatch.setattr(pipeline, "run_pipeline", crash)
    with pytest.raises(RuntimeError, match="launcher crashed"):
        main([TINY_EXAMPLE, "--history", "--no-check-paths", "--run-id", "r-crash", f"runs_root={tmp_path}"])
    records, warnings = history.read_history(history.history_path(str(tmp_path)))
    assert not warnings and len(records) == 1
    rec = records[0]
    assert (rec["run_id"], rec["status"], rec["example"]) == ("r-crash", INTERRUPTED, TINY_EXAMPLE)
    assert rec["stages"]["quantize"]["status"] == "running" and rec["errors"][0].startswith(
        "interrupted: quantize was running")
    assert "history: interrupted run r-crash appended" in capsys.readouterr().out


def test_since_and_example_select_runs():
    import datetime as dt

    from launcher.report.build import parse_since, select

    now = dt.datetime(2026, 12, 4, 3, 0)
    assert parse_since("30d", now) == dt.datetime(2026, 11, 4, 3, 0)
    assert parse_since("2026-11-02") == dt.datetime(2026, 11, 2)
    recs = [{"run_id": "20261101-010000-aaaa", "job_name": "tiny-fp8", "created": None},
            {"run_id": "r2", "job_name": "tiny-nvfp4", "created": "2026-11-03T01:00:00",
             "example": "examples/tiny/Qwen3-MoE-tiny/megatron_lm_ptq.yaml"}]
    assert [r["run_id"] for r in select(recs, parse_since("2026-11-02"))] == ["r2"]     # run id's date
    assert [r["run_id"] for r in select(recs, None, "tiny-fp8,nemotron*")] == ["20261101-010000-aaaa"]
    assert [r["run_id"] for r in select(recs, None, "examples/tiny/Qwen3*")] == ["r2"]
    assert [r["run_id"] for r in select(recs)] == ["20261101-010000-aaaa", "r2"]
