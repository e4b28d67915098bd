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
    assert meta["run_id"] == "r1" and meta["stages"]["vllm_smoke"]["status"] == "pending"
    assert run.path == os.path.join(str(tmp_path), cfg.job_name, "r1")
    off = compose_example(NANO, [f"runs_root={tmp_path}", "stages.vllm_smoke.enabled=false",
                                 "stages.vllm_smoke.disabled_reason=no vLLM on this cluster"])
    meta = RunDirectory.create(off, run_id="r2").metadata()
    assert meta["stages"]["vllm_smoke"] == {"status": "disabled", "reason": "no vLLM on this cluster"}


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


# -- outputs in the manifest, and the resume rule after a job that ended otherwise than COMPLETED ----
def _publish_export(run: RunDirectory) -> str:
    d = run.stage_dir("export")
    os.makedirs(os.path.join(d, "hf"), exist_ok=True)
    for rel, data in {"hf/model.safetensors": b"\x01" * 1000, "hf/config.json": b"{}", "verify.json": b'{"ok": true}',
                      "log.txt": b"rank lines", "hf.rejected/model.safetensors": b"old",
                      "hf.tmp-export/partial.safetensors": b"half", "verify.json.tmp-12": b"{"}.items():
        os.makedirs(os.path.dirname(os.path.join(d, rel)), exist_ok=True)
        with open(os.path.join(d, rel), "wb") as f:
            f.write(data)
    return d


def test_manifest_lists_published_outputs_and_verify_outputs_rechecks_them(tmp_path):
    from launcher.rundir import verify_outputs

    cfg = compose_example(NANO, [f"runs_root={tmp_path}"])
    run = RunDirectory.create(cfg, run_id="r3")
    d = _publish_export(run)
    write_manifest(run.path, cfg, "export")
    outputs = run.manifest("export")["outputs"]
    # log, manifest, temporary names and set-aside entries are not outputs
    assert sorted(outputs) == ["hf/config.json", "hf/model.safetensors", "verify.json"]
    assert outputs["hf/model.safetensors"]["size"] == 1000 and len(outputs["verify.json"]["sha256"]) == 64
    assert run.verify_outputs("export") == []
    with open(os.path.join(d, "log.txt"), "a") as f:   # the executor keeps appending to the log
        f.write("more")
    assert run.verify_outputs("export") == []
    with open(os.path.join(d, "hf", "model.safetensors"), "r+b") as f:   # same size, one byte changed
        f.seek(500)
        f.write(b"\x02")
    assert run.verify_outputs("export") == ["hf/model.safetensors: sha256 differs from the manifest's"]
    os.remove(os.path.join(d, "hf", "config.json"))
    with open(os.path.join(d, "hf", "extra.bin"), "wb") as f:
        f.write(b"x")
    assert run.verify_outputs("export") == ["hf/config.json: missing", "hf/model.safetensors: sha256 differs "
                                            "from the manifest's", "hf/extra.bin: not in the manifest"]
    with open(os.path.join(d, "verify.json"), "wb") as f:
        f.write(b"{}")
    assert "verify.json: 2 bytes, the manifest says 12" in run.verify_outputs("export")
    assert verify_outputs(d, {"stage": "export"}) == [
        "the manifest lists no outputs (written by an older launcher): cannot re-verify"]


def _node_failed_export(tmp_path, run_id: str):
    cfg = compose_example(NANO, [f"runs_root={tmp_path}", "stages.vllm_smoke.enabled=false"])
    run = RunDirectory.create(cfg, run_id=run_id)
    for s in ("quantize", "mmlu"):
        write_manifest(run.path, cfg, s)
        run.update_stage(s, status="completed")
    d = _publish_export(run)
    write_manifest(run.path, cfg, "export")
    run.update_stage("export", status="node_fail", state="NODE_FAIL")
    return cfg, run, d


def test_resume_reverifies_a_stage_whose_job_ended_node_fail_after_its_manifest(tmp_path, capsys):
    from launcher.pipeline import stages_to_run

    cfg, run, d = _node_failed_export(tmp_path, "r4")
    assert stages_to_run(cfg, run, resume=True) == []   # vllm_smoke is disabled here
    st = run.metadata()["stages"]
    assert (st["quantize"]["status"], st["mmlu"]["status"]) == ("skipped", "skipped")
    assert st["quantize"]["reason"] == "resume: manifest matches the config"
    assert (st["export"]["status"], st["export"]["reason"]) == (
        "skipped", "resume: outputs re-verified against the manifest (3 files; the stage's job had ended node_fail)")
    assert "[launch] export: skipped (resume: outputs re-verified" in capsys.readouterr().out
    assert os.path.isdir(os.path.join(d, "hf")) and run.manifest("export")


def test_resume_redoes_a_node_fail_stage_whose_outputs_do_not_verify(tmp_path, capsys):
    from launcher.pipeline import stages_to_run

    cfg, run, d = _node_failed_export(tmp_path, "r5")
    os.truncate(os.path.join(d, "hf", "model.safetensors"), 10)
    assert stages_to_run(cfg, run, resume=True) == ["export"]
    out = capsys.readouterr().out
    assert ("[launch] export: outputs do not match the manifest (the stage's job had ended node_fail): "
            "hf/model.safetensors: 10 bytes, the manifest says 1000") in out
    assert "[launch] export: set aside hf.stale, verify.json.stale; redoing the stage" in out
    # set aside, not deleted; the export stage then finds no export/hf in its way
    assert not os.path.exists(os.path.join(d, "hf")) and not os.path.exists(os.path.join(d, "verify.json"))
    assert os.path.getsize(os.path.join(d, "hf.stale", "model.safetensors")) == 10
    assert run.manifest("export") is None
    assert run.metadata()["stages"]["export"]["reverify_problems"] == [
        "hf/model.safetensors: 10 bytes, the manifest says 1000"]


def test_a_completed_stage_is_trusted_on_resume_as_before(tmp_path):
    from launcher.pipeline import stages_to_run

    cfg, run, d = _node_failed_export(tmp_path, "r6")
    run.update_stage("export", status="completed")
    os.truncate(os.path.join(d, "hf", "model.safetensors"), 10)   # not re-read: COMPLETED is trusted
    assert stages_to_run(cfg, run, resume=True) == []


def test_forget_manifests_before_a_rerun(tmp_path):
    from launcher.pipeline import forget_manifests

    cfg, run, _ = _node_failed_export(tmp_path, "r7")
    forget_manifests(run, ["mmlu", "export"])
    assert run.manifest("quantize") and run.manifest("mmlu") is None and run.manifest("export") is None
