"""Run directory: masked secrets, stage hashes that follow upstream config, manifests."""
import os

from launcher.config.compose import compose_example
from launcher.rundir import MASK, RunDirectory, stage_config_hash, write_manifest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NANO = os.path.join(ROOT, "examples/nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16/megatron_lm_ptq.yaml")


def test_config_yaml_masks_secrets(tmp_path):
    cfg = compose_example(NANO, [f"runs_root={tmp_path}", "+env.HF_TOKEN=hf_abcdef", "+env.NCCL_DEBUG=INFO"])
    run = RunDirectory.create(cfg, run_id="r1")
    text = open(run.config_path()).read()
    assert "hf_abcdef" not in text and f"HF_TOKEN: '{MASK}'" in text and "NCCL_DEBUG: INFO" in text
    meta = run.metadata()
    assert meta["run_id"] == "r1" and meta["stages"]["vllm_smoke"]["status"] == "disabled"
    assert "Blackwell" in meta["stages"]["vllm_smoke"]["reason"]
    assert run.path == os.path.join(str(tmp_path), cfg.job_name, "r1")


def test_stage_hash_changes_only_downstream():
    base = compose_example(NANO, [])
    changed_gate = compose_example(NANO, ["stages.mmlu.lower_bound=0.5"])
    changed_recipe = compose_example(NANO, ["recipe=fp8_default"])
    other_executor = compose_example(NANO, ["executor=slurm", "job_name=other", "note=x"])
    assert stage_config_hash(base, "quantize") == stage_config_hash(changed_gate, "quantize")
    assert stage_config_hash(base, "mmlu") != stage_config_hash(changed_gate, "mmlu")
    assert stage_config_hash(base, "export") != stage_config_hash(changed_gate, "export")
    for s in ("quantize", "mmlu", "export", "vllm_smoke"):
        assert stage_config_hash(base, s) != stage_config_hash(changed_recipe, s)
        assert stage_config_hash(base, s) == stage_config_hash(other_executor, s)


def test_manifest_matches_only_the_same_config(tmp_path):
    cfg = compose_example(NANO, [f"runs_root={tmp_path}"])
    run = RunDirectory.create(cfg, run_id="r2")
    assert not run.stage_is_current(cfg, "quantize")
    write_manifest(run.path, cfg, "quantize")
    assert run.stage_is_current(cfg, "quantize")
    assert not run.stage_is_current(compose_example(NANO, ["stages.quantize.calib.size=64"]), "quantize")
