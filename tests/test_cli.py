"""`launch` verbs: dry run (no torch), flags anywhere, exit codes and messages."""
import json
import os
import subprocess
import sys

import pytest

from launcher.cli import main, parse_args

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NANO = "examples/nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16/megatron_lm_ptq.yaml"


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "launcher.cli", *args], cwd=ROOT, capture_output=True, text=True)


def test_dry_run_json_nano_plan_without_torch():
    code = ("import sys, io, contextlib, json; from launcher.cli import main\n"
            "buf = io.StringIO()\n"
            f"with contextlib.redirect_stdout(buf): rc = main([{NANO!r}, '--dry-run', '--json'])\n"
            "assert rc == 0, rc\n"
            "assert 'torch' not in sys.modules, 'dry run imported torch'\n"
            "print(buf.getvalue())")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    stages = {s["name"]: s for s in plan["stages"]}
    assert plan["job_name"] == "nemotron3-nano-30b-a3b-nvfp4"
    for name in ("quantize", "mmlu"):
        assert {k: stages[name][k] for k in ("world_size", "tp", "pp", "ep", "etp", "cp", "dp", "edp")} == {
            "world_size": 4, "tp": 1, "pp": 1, "ep": 4, "etp": 1, "cp": 1, "dp": 4, "edp": 1}
    assert (stages["export"]["pp"], stages["export"]["ep"], stages["export"]["tp"]) == (4, 1, 1)
    assert stages["vllm_smoke"]["enabled"] is True and stages["vllm_smoke"]["world_size"] == 1


def test_flags_before_or_after_overrides_give_the_same_plan():
    a = run_cli("--dry-run", "--json", NANO, "stages.mmlu.shard_mode=lockstep")
    b = run_cli(NANO, "stages.mmlu.shard_mode=lockstep", "--json", "--dry-run")
    assert a.returncode == b.returncode == 0, a.stderr + b.stderr
    assert json.loads(a.stdout) == json.loads(b.stdout)
    mmlu = [s for s in json.loads(a.stdout)["stages"] if s["name"] == "mmlu"][0]
    assert (mmlu["shard_mode"], mmlu["shard_group"]) == ("lockstep", "edp")


def test_human_dry_run_shows_groups_and_commands():
    proc = run_cli(NANO, "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert "## quantize: world 4 = tp 1 x cp 1 x dp 4 x pp 1; experts: etp 1 x ep 4 x edp 1 x pp 1" in proc.stdout
    assert "## export: world 4 = tp 1 x cp 1 x dp 1 x pp 4" in proc.stdout
    assert "ep        [[0, 1, 2, 3]]" in proc.stdout
    assert "-m launcher.worker mmlu" in proc.stdout


def test_invalid_ep_exits_2_naming_key_value_and_experts():
    proc = run_cli(NANO, "stages.quantize.parallel.ep=3", "--dry-run")
    assert proc.returncode == 2
    assert "stages.quantize.parallel.ep=3: must divide model.num_experts=128" in proc.stderr


def test_dryrun_misspelling_is_refused_with_a_hint():
    proc = run_cli(NANO, "--dryrun")
    assert proc.returncode == 2
    assert "unknown flag --dryrun (did you mean --dry-run?)" in proc.stderr


def test_validate_verb():
    ok = run_cli("validate", NANO, "--no-check-paths")
    assert ok.returncode == 0 and "is valid" in ok.stdout, ok.stderr
    bad = run_cli("validate", NANO, "stages.mmlu.fraction=2")
    assert bad.returncode == 2 and "stages.mmlu.fraction=2.0: must satisfy 0 < fraction <= 1" in bad.stderr


def test_missing_config_and_status_of_non_run_dir(tmp_path):
    assert main(["does/not/exist.yaml", "--dry-run"]) == 2
    assert main(["status", str(tmp_path)]) == 2


def test_parse_args_value_flags():
    a = parse_args(["x.yaml", "--resume", "/r", "a=1", "--detach", "--test-level=2"])
    assert a.positional == ["x.yaml", "a=1"]
    assert a.flags == {"--resume": "/r", "--detach": True, "--test-level": "2"}
    with pytest.raises(ValueError, match="--resume needs a value"):
        parse_args(["x.yaml", "--resume"])
