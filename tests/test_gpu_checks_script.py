"""scripts/gpu_checks.sh's own plumbing, on CPU: part names checked before anything runs, parts run
side by side (PART+PART) with each exit status and seconds in parts.txt, the group's wall in the report.

The script runs from a copy of scripts/ alone (no .whl, .cache or .bench: the preamble installs nothing),
with the `stash` part, which does nothing but what every call does first."""
from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def script_root(tmp_path):
    root = tmp_path / "root"
    (root / "scripts").mkdir(parents=True)
    for name in ("gpu_checks.sh", "gpu_report.py", "torch_ext_cache.sh"):
        shutil.copy(os.path.join(ROOT, "scripts", name), root / "scripts" / name)
    return root


def _run(root, out, *parts):
    env = {k: v for k, v in os.environ.items() if k not in ("PTQ_CACHE_DIR", "PYTHONPATH")}
    env.update(VLLM_PARTS=str(out.parent / "vllm-parts"), TE_PARTS=str(out.parent / "te-parts"),
               PTQ_COMMIT="abc1234")
    return subprocess.run(["bash", str(root / "scripts" / "gpu_checks.sh"), str(out), *parts], cwd=root, env=env,
                          capture_output=True, text=True, timeout=120)


def test_unknown_part_is_refused_before_anything_runs(script_root, tmp_path):
    out = tmp_path / "out"
    p = _run(script_root, out, "stash", "tests+pipelin")
    assert p.returncode == 2, p.stdout + p.stderr
    assert "unknown part 'pipelin'" in p.stdout
    assert "PART+PART runs parts side by side" in p.stdout
    assert not out.exists()   # not even the report directory: the first part did not run


def test_side_by_side_group_then_a_part(script_root, tmp_path):
    out = tmp_path / "out"
    p = _run(script_root, out, "stash+stash", "stash")
    assert p.returncode == 0, p.stdout + p.stderr
    lines = (out / "parts.txt").read_text().splitlines()
    assert [ln for ln in lines if ln.startswith("== ")] == [
        "== stash: exit 0 in 0 s", "== stash: exit 0 in 0 s", "== group stash+stash: 0 s", "== stash: exit 0 in 0 s"]
    report = json.loads((out / "report.json").read_text())
    assert report["commit"] == "abc1234"
    assert report["side_by_side_s"] == {"stash+stash": 0}
    assert report["parts"] == {"stash": {"exit": 0, "seconds": 0, "pass": True}}
    assert report["all_pass"] is True
    assert "---- stash (tail)" in p.stdout


def test_a_failing_part_fails_the_call_and_its_neighbour_still_runs(script_root, tmp_path):
    """vllm-install fails here (the copy has no scripts/vllm_wheelhouse.py): the call exits 1, the part
    beside it completes, and the report says which part failed."""
    out = tmp_path / "out"
    p = _run(script_root, out, "vllm-install+stash")
    assert p.returncode == 1, p.stdout + p.stderr
    report = json.loads((out / "report.json").read_text())
    assert report["parts"]["stash"]["pass"] is True
    assert report["parts"]["vllm-install"]["pass"] is False and report["parts"]["vllm-install"]["exit"] != 0
    assert report["all_pass"] is False
    assert list(report["side_by_side_s"]) == ["vllm-install+stash"]
