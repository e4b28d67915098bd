"""launcher/contract.py: the shared vocabulary is defined once and the rest of the launcher speaks it."""
import ast
import dataclasses
import json
import os

import pytest

from conftest import ROOT
from launcher import contract
from launcher.schema import Stages
from launcher.contract import (
    STAGE_ORDER, ExitCode, JobState, RunLayout, StageFailed, StageStatus, atomic_dir, split_secrets,
    write_json_atomic)


def test_contract_imports_nothing_of_the_launcher_and_no_torch():
    tree = ast.parse(open(contract.__file__).read())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert imported == {"__future__", "contextlib", "enum", "json", "os", "re", "shutil", "typing"}


def test_stage_order_is_the_schemas_stages():
    assert STAGE_ORDER == tuple(f.name for f in dataclasses.fields(Stages)) == (
        "quantize", "mmlu", "export", "vllm_smoke")


def test_words_as_written_to_files_and_exit_codes():
    assert json.dumps({"status": StageStatus.COMPLETED, "state": JobState.TIMEOUT, "exit": ExitCode.GATE_FAILED}) == (
        '{"status": "completed", "state": "TIMEOUT", "exit": 3}')
    assert [int(c) for c in ExitCode] == [0, 1, 2, 3, 4, 5, 130]
    assert f"{StageStatus.NOT_RUN:<8}|" == "not_run |"
    assert StageFailed("x").exit_code == ExitCode.FAILED == 1


def test_no_module_spells_the_exit_codes_or_statuses_again():
    """Every launcher module takes exit codes and stage statuses from launcher.contract."""
    offenders = []
    for dirpath, _, files in os.walk(os.path.join(ROOT, "launcher")):
        for f in files:
            path = os.path.join(dirpath, f)
            if not f.endswith(".py") or path == contract.__file__:
                continue
            text = open(path).read()
            for needle in ("EXIT_GATE_FAILED =", "EXIT_DESYNC =", "EXIT_PREFLIGHT =", '"not_run"', '"submitted"',
                           '= "COMPLETED"', 'PENDING, RUNNING, COMPLETED, FAILED, SKIPPED, DISABLED, CANCELLED = (\n    "'):
                if needle in text:
                    offenders.append(f"{os.path.relpath(path, ROOT)}: {needle!r}")
    assert offenders == []


def test_run_layout_paths(tmp_path):
    lay = RunLayout(str(tmp_path))
    got = {k: os.path.relpath(v, tmp_path) for k, v in {
        "config": lay.config_yaml, "meta": lay.metadata_json, "log": lay.log("mmlu"), "manifest": lay.manifest("export"),
        "skip": lay.skip("vllm_smoke"), "ckpt": lay.quantize_checkpoint, "summary": lay.quantize_summary,
        "results": lay.mmlu_results, "export": lay.export_dir("hf"), "verify": lay.export_verify,
        "responses": lay.vllm_responses, "jobs": lay.slurm_jobs}.items()}
    assert got == {"config": "config.yaml", "meta": "metadata.json", "log": "mmlu/log.txt",
                   "manifest": "export/manifest.json", "skip": "vllm_smoke/skip.json", "ckpt": "quantize/checkpoint",
                   "summary": "quantize/summary.json", "results": "mmlu/results.json", "export": "export/hf",
                   "verify": "export/verify.json", "responses": "vllm_smoke/responses.json", "jobs": "slurm/jobs.json"}


def test_secret_rule():
    plain, secret = split_secrets({"HF_TOKEN": "a", "HF_HOME": "b", "AWS_SECRET_ACCESS_KEY": "c", "my_api_key": "d"})
    assert plain == {"HF_HOME": "b"} and set(secret) == {"HF_TOKEN", "AWS_SECRET_ACCESS_KEY", "my_api_key"}


def test_atomic_writers_leave_no_partial_output(tmp_path):
    path = tmp_path / "sub" / "x.json"
    write_json_atomic(str(path), {"a": 1})
    assert path.read_text() == '{\n  "a": 1\n}\n' and os.listdir(path.parent) == ["x.json"]
    final = tmp_path / "out"
    with pytest.raises(KeyError):
        with atomic_dir(str(final)) as tmp:
            open(os.path.join(tmp, "f"), "w").close()
            raise KeyError("interrupted")
    assert not final.exists() and os.listdir(tmp_path) == ["sub"]
    with atomic_dir(str(final)) as tmp:
        open(os.path.join(tmp, "f"), "w").close()
    assert os.listdir(final) == ["f"]
    with pytest.raises(StageFailed, match="exists; refusing to overwrite"):
        with atomic_dir(str(final)):
            pass
