"""scripts/te_trial.py, the GPU trial of Megatron's TransformerEngine spec, run here for its plumbing:
on CPU with the local spec only, over the session's tiny run (tests/shared_runs.py), the first 48 of the
gate's questions are evaluated from the run's own config and compared with the gate's recorded
predictions. Without TE, asking for the TE spec writes the import error as the trial's answer."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "te_trial.py")

pytestmark = pytest.mark.slow   # a Megatron model on CPU, and the session's tiny run


def _trial(run_dir, out, *args) -> subprocess.CompletedProcess:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run([sys.executable, SCRIPT, str(run_dir), "--out", str(out), *args], env=env,
                          capture_output=True, text=True, timeout=600)


def test_the_local_spec_reproduces_the_gate_runs_predictions_on_cpu(tiny_run, tmp_path):
    out = tmp_path / "te_trial.json"
    p = _trial(tiny_run.completed, out, "--device", "cpu", "--specs", "local", "--quant", "none", "--limit", "48")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["specs"] == ["local"] and doc["transformer_engine"] is None and doc["device"] == "cpu"
    local = doc["recipes"]["none"]["local"]
    # the trained tiny model: the gate's bound is 0.85; a broken prompt/choice plumbing scores ~0.25
    assert local["accuracy"] >= 0.85, local
    # the gate ran NVFP4 with folded, grouped experts on 4 ranks; unquantized here: near, not equal
    assert local["agrees_with_the_gate_run"] >= 0.9, local
    assert "local_vs_te" not in doc["recipes"]["none"]


@pytest.mark.skipif(__import__("importlib").util.find_spec("transformer_engine") is not None,
                    reason="TransformerEngine is installed here")
def test_asking_for_the_te_spec_without_te_records_the_import_error(tiny_run, tmp_path):
    out = tmp_path / "te_trial.json"
    p = _trial(tiny_run.completed, out, "--device", "cpu")
    assert p.returncode == 1
    doc = json.loads(out.read_text())
    assert doc["transformer_engine"] is None and doc["recipes"] == {}
    assert doc["error"].startswith("import transformer_engine.pytorch: ModuleNotFoundError: "
                                   "No module named 'transformer_engine'"), doc["error"]


def test_bad_arguments_name_the_valid_values(tmp_path):
    p = _trial(tmp_path, tmp_path / "x.json", "--specs", "te,te")
    assert p.returncode == 2 and "--specs: 'te,te' not valid; valid: 'local', 'te' or 'local,te'" in p.stderr
    p = _trial(tmp_path, tmp_path / "x.json", "--quant", "int4")
    assert p.returncode == 2 and "--quant: ['int4'] not valid; valid values: ['none', 'nvfp4', 'fp8']" in p.stderr
