"""The tiny pipeline end to end on 4 local gloo ranks, killed, resumed, and gated.

The kill and the resume are the session's shared run (tests/shared_runs.py, ``tiny_run``: made once,
read here through copies):
  1. SIGKILL one quantize rank mid-stage -> `launch` exits non-zero, quantize marked failed,
     no partial checkpoint at quantize/checkpoint, later stages not run;
  2. --resume -> quantize (EP4), MMLU gate (EP4) passes, export (PP4) verifies, vLLM smoke
     records a skip with its reason (NVFP4 cannot be served on CPU); exit 0;
  3. --resume (of a copy of the completed run) with stages.mmlu.lower_bound=0.99 -> quantize
     skipped (manifest matches), the gate fails on every rank (exit 3 from each), export not run;
plus the preflight of every stage (issue 2's done-when).
"""
import json
import os

import pytest

from shared_runs import finish, launch, meta

pytestmark = pytest.mark.slow


def test_preflight_every_stage_on_gloo(tmp_path, tiny_dir):
    proc = launch(f"runs_root={tmp_path}", "--preflight")
    code, out = finish(proc)
    assert code == 0, out
    for stage in ("quantize", "mmlu", "export"):
        assert f"[{stage} r0" in out and "preflight ok" in out
    run_dir = out.split("[launch] run directory: ")[1].split("\n")[0]
    assert {s: v["status"] for s, v in meta(run_dir)["stages"].items()} == {
        "quantize": "completed", "mmlu": "completed", "export": "completed", "vllm_smoke": "completed"}


def test_kill_fails_quantize_and_publishes_nothing(tiny_run, tmp_path):
    """1. rank 1 killed during quantize, once calibration had started (the shared run's first launch)."""
    code, out = tiny_run.killed_code, tiny_run.killed_out
    assert code != 0, out
    run_dir = str(tiny_run.copy_killed(tmp_path / "runs"))
    m = meta(run_dir)
    assert m["stages"]["quantize"]["status"] == "failed", m
    assert m["stages"]["mmlu"]["status"] == "not_run" and m["stages"]["export"]["status"] == "not_run"
    assert not os.path.exists(os.path.join(run_dir, "quantize", "checkpoint")), "partial checkpoint at final path"
    assert not os.path.exists(os.path.join(run_dir, "quantize", "manifest.json"))


def test_resume_runs_every_stage(tiny_run, tmp_path):
    """2. resume: everything runs and passes (the shared run's second launch)."""
    code, out = tiny_run.resume_code, tiny_run.resume_out
    assert code == 0, out
    assert out.count("[local-agent] 4 rank(s) forked after one import of torch") == 3, out   # CPU: forked
    # every stage's agent (the smoke's too: it starts, then records its skip) forked from one zygote
    assert out.count("s, once for the run; torch is a CPU build)") == 4, out
    run_dir = str(tiny_run.copy_completed(tmp_path / "runs"))
    m = meta(run_dir)
    assert [m["stages"][s]["status"] for s in ("quantize", "mmlu", "export", "vllm_smoke")] == [
        "completed", "completed", "completed", "skipped"], m
    assert "NVFP4" in m["stages"]["vllm_smoke"]["reason"]
    with open(os.path.join(run_dir, "quantize", "summary.json")) as f:
        summary = json.load(f)["summary"]
    assert summary["expert_linears"] > 0 and summary["expert_linears_weight_quantized"] == summary["expert_linears"]
    with open(os.path.join(run_dir, "mmlu", "results.json")) as f:
        results = json.load(f)
    assert results["pass"] is True and results["accuracy"] >= 0.85, results["accuracy"]
    with open(os.path.join(run_dir, "export", "verify.json")) as f:
        verify = json.load(f)
    assert verify["ok"] is True, verify


def test_export_profiled_on_every_rank_and_not_an_output(tiny_run, tmp_path):
    """PTQ_PROFILE=export (the shared run's resume): each of the export's 4 ranks (PP4) writes its
    profile beside the stage's log, the profile names ModelOpt's Megatron->HF exporter, and the
    profiles are not outputs: the manifest does not list them and re-verifies without them."""
    import pstats

    from launcher.rundir import verify_outputs

    run_dir = str(tiny_run.copy_completed(tmp_path / "runs"))
    export = os.path.join(run_dir, "export")
    names = sorted(n for n in os.listdir(export) if n.startswith("profile-rank"))
    assert names == [f"profile-rank{r}.{ext}" for r in range(4) for ext in ("pstats", "txt")]
    with open(os.path.join(export, "profile-rank0.txt")) as f:
        text = f.read()
    assert text.startswith("==== by cumulative ====") and "==== by tottime ====" in text
    # The raw profile holds every function called; the text keeps only the costliest 40, and on a
    # tiny model the exporter's own frame may rank below the model build (it did on CI's machine).
    called = {name for (_file, _line, name) in pstats.Stats(os.path.join(export, "profile-rank0.pstats")).stats}
    assert "export_mcore_gpt_to_hf" in called, sorted(called)[:50]
    with open(os.path.join(export, "manifest.json")) as f:
        manifest = json.load(f)
    assert not [rel for rel in manifest["outputs"] if "profile-rank" in rel]
    assert verify_outputs(export, manifest) == []
    with open(os.path.join(export, "log.txt")) as f:
        assert "profiling (PTQ_PROFILE): " in f.read()


def test_resume_with_unreachable_bound_fails_the_gate(tiny_run, tmp_path):
    """3. resume (a copy of the completed run) with an unreachable bound: quantize is not redone,
    the gate fails on every rank.  Its ranks are spawned (executor.rank_start=spawn; every other local
    run here forks them on this CPU machine): the spawned path's exit codes reach the pipeline too."""
    assert tiny_run.resume_code == 0, tiny_run.resume_out
    runs = str(tmp_path / "runs")
    run_dir = str(tiny_run.copy_completed(runs))
    first_quantize_finish = json.load(open(os.path.join(run_dir, "quantize", "manifest.json")))["finished"]
    code, out = finish(launch(f"runs_root={runs}", "--resume", run_dir, "stages.mmlu.lower_bound=0.99",
                              "executor.rank_start=spawn"))
    assert code == 3, out
    assert "forked after one import" not in out, out
    assert "quantize: skipped (resume: manifest matches the config)" in out
    assert json.load(open(os.path.join(run_dir, "quantize", "manifest.json")))["finished"] == first_quantize_finish
    for rank in range(4):
        assert f"[mmlu r{rank}] STAGE FAILED" in out, f"rank {rank} did not fail the gate:\n{out[-3000:]}"
    m = meta(run_dir)
    assert m["stages"]["mmlu"]["status"] == "failed" and m["stages"]["mmlu"]["exit_code"] == 3
    assert m["stages"]["export"]["status"] == "not_run"
    with open(os.path.join(run_dir, "mmlu", "results.json")) as f:
        assert json.load(f)["pass"] is False
