"""The SmolLM2 example end to end through `launch`, each stage at another layout that divides the model.

FP8: quantize at TP3 (3 ranks) -> the paired gate at PP2xDP2 (4 ranks) against the evaluated
baseline -> export at PP2 (2 ranks), verified; `launch verify` passes on the export; the
baseline's per-question scores equal lm-eval's (tests/golden) at this layout too.
recipe=none: export at PP3 straight from the HF weights; transformers loads it and gives the
original logits exactly.  Both exports hold the tied embedding once (no lm_head.weight).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from launcher_testing.ranks import REPO_ROOT
from test_smollm2_layouts import PROMPTS, SCORE_TOLERANCE, _centered, load_golden

pytestmark = pytest.mark.slow

EXAMPLE = os.path.join(REPO_ROOT, "examples", "HuggingFaceTB", "SmolLM2-135M-Instruct", "megatron_lm_ptq.yaml")
GATE_QUESTIONS = 20


def launch(*args, timeout=900):
    proc = subprocess.run([sys.executable, "-m", "launcher.cli", *args], cwd=REPO_ROOT, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr


def run_dir_of(out: str) -> str:
    return out.split("[launch] run directory: ")[1].split("\n")[0].strip()


def read(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def assert_tied_once(export_dir: str) -> None:
    index = read(os.path.join(export_dir, "model.safetensors.index.json"))["weight_map"]
    assert [k for k in index if "embed" in k or "lm_head" in k] == ["model.embed_tokens.weight"]
    assert read(os.path.join(export_dir, "config.json"))["tie_word_embeddings"] is True


def test_fp8_tp3_quantize_pp2dp2_gate_pp2_export(smollm2_dir, tmp_path):
    golden = load_golden()["sets"]["0"]
    data = tmp_path / "mmlu.jsonl"
    data.write_text("".join(json.dumps(q) + "\n" for q in golden["questions"][:GATE_QUESTIONS]))
    code, out = launch(EXAMPLE, f"runs_root={tmp_path}/runs",
                       "stages.quantize.parallel.tp=3", "stages.quantize.parallel.pp=1",
                       "stages.quantize.parallel.world_size=3", "stages.quantize.calib.size=4",
                       "stages.quantize.calib.max_seq_len=128", "stages.quantize.calib.batch_size=2",
                       "stages.mmlu.parallel.pp=2", "stages.mmlu.parallel.world_size=4", f"stages.mmlu.dataset={data}",
                       "stages.mmlu.fraction=1.0", "stages.mmlu.max_drop=0.25",
                       f"stages.mmlu.baseline_cache_dir={tmp_path}/baseline_cache")
    assert code == 0, out[-6000:]
    run = run_dir_of(out)
    meta = read(os.path.join(run, "metadata.json"))
    assert [meta["stages"][s]["status"] for s in ("quantize", "mmlu", "export")] == ["completed"] * 3
    summary = read(os.path.join(run, "quantize", "summary.json"))
    assert (summary["layout"]["tp"], summary["layout"]["world_size"]) == (3, 3)
    assert summary["quantized"] is True and summary["checks"]["passed"] is True

    res = read(os.path.join(run, "mmlu", "results.json"))
    qs = res["questions"]
    assert res["n"] == GATE_QUESTIONS and res["baseline"]["source"] == "evaluated"
    assert os.path.isfile(res["baseline"]["cache"])
    n10 = sum(q["baseline_prediction"] == q["answer"] != q["prediction"] for q in qs)
    n01 = sum(q["prediction"] == q["answer"] != q["baseline_prediction"] for q in qs)
    paired = res["baseline"]["paired"]
    assert (paired["n10"], paired["n01"], paired["method"]) == (n10, n01, "mcnemar_exact")
    assert res["baseline"]["drop"] == pytest.approx((n10 - n01) / GATE_QUESTIONS, abs=1e-12)
    lo, hi = paired["interval"]
    # the interval's end equals the drop when every discordant question went one way; both are
    # computed in floating point, so they may differ in the last bit (-0.05 vs -0.05000000000000002)
    assert lo - 1e-12 <= res["baseline"]["drop"] <= hi + 1e-12
    assert res["agreement"] == sum(q["baseline_prediction"] == q["prediction"] for q in qs) / GATE_QUESTIONS
    assert res["mean_kl"] > 0, "FP8 fake quantization moves the answer distributions"
    # the baseline at PP2xDP2 is lm-eval's transformers model, question by question
    for q, ref in zip(qs, golden["lm_eval"]):
        assert q["baseline_prediction"] == "ABCD"[ref["prediction"]]
        diff = max(abs(a - b) for a, b in zip(_centered(q["baseline_logits"]), _centered(ref["loglikelihoods"])))
        assert diff < SCORE_TOLERANCE, (q, ref)

    verify = read(os.path.join(run, "export", "verify.json"))
    assert verify["ok"] is True and verify["checks"]["tied_embeddings"] == {
        "tied": True, "lm_head_tensors": 0, "embedding_tensors": 1}, verify
    export_dir = os.path.join(run, "export", "hf")
    assert_tied_once(export_dir)
    code, out = launch("verify", export_dir, "--recipe", "fp8_default", "--source", smollm2_dir, timeout=300)
    assert code == 0, out[-3000:]


def test_recipe_none_pp3_export_gives_the_original_logits(smollm2_dir, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    code, out = launch(EXAMPLE, f"runs_root={tmp_path}/runs", "recipe=none", "stages.quantize.enabled=false",
                       "stages.mmlu.enabled=false", "stages.export.parallel.pp=3", "stages.export.parallel.world_size=3")
    assert code == 0, out[-6000:]
    run = run_dir_of(out)
    assert read(os.path.join(run, "export", "verify.json"))["ok"] is True
    export_dir = os.path.join(run, "export", "hf")
    assert_tied_once(export_dir)
    tok = AutoTokenizer.from_pretrained(export_dir)
    ids = tok(PROMPTS[1], return_tensors="pt").input_ids
    with torch.no_grad():
        exported = AutoModelForCausalLM.from_pretrained(export_dir, dtype=torch.float32).eval()
        original = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
        assert exported.lm_head.weight.data_ptr() == exported.model.embed_tokens.weight.data_ptr()
        assert torch.equal(exported(ids).logits, original(ids).logits)
