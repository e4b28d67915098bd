"""SmolLM2-135M-Instruct (a real checkpoint: tied embeddings, 9 heads / 3 KV heads) at every
layout class that divides it, on gloo ranks; the gate against lm-evaluation-harness's numbers.

One 3-rank job: Megatron logits equal transformers' at TP3 and PP3 (PP>1 ties the embedding to
the last stage through cpu_compat's tied_embeddings_pp shim); then, at TP3, the mmlu stage on the
questions of tests/golden/smollm2_mmlu_lm_eval.json (written by scripts/mmlu_lm_eval_oracle.py
with lm-eval's own MMLU task) at 0 and 5 shots, compared question by question with lm-eval's
log-likelihoods; and the cached baseline: baseline=evaluate stores it, baseline=cached reuses it
(drop 0, KL 0 on the same weights), a key that differs (few_shots) fails naming the field.
One 4-rank job: the logits at PP2xDP2.  Layouts that do not divide the model are refused by
validation (tp=2, pp=4), before anything starts.
"""
from __future__ import annotations

import json
import os
import sys

import pytest

from launcher_testing.ranks import REPO_ROOT, run_on_ranks

pytestmark = pytest.mark.slow

GOLDEN = os.path.join(REPO_ROOT, "tests", "golden", "smollm2_mmlu_lm_eval.json")
LAST_TOKEN_TOLERANCE = 1e-4   # max |megatron - transformers| of the logits the gate reads (fp32)
ALL_POSITIONS_TOLERANCE = 1e-3  # every real position: fp32 noise of a 30-layer model (transformers' own
#                                 sdpa vs eager differ by 2e-4 here, fp32 vs fp64 by 4e-4)
SCORE_TOLERANCE = 1e-3        # per-choice scores (centered) vs lm-eval's log-likelihoods
TIE_MARGIN = 1e-4             # lm-eval's top-2 margin below which predictions are not compared
PROMPTS = ["The capital of France is",
           "The following are multiple choice questions (with answers) about astronomy.\n\n"
           "What is the closest star to Earth?\nA. Proxima Centauri\nB. The Sun\nC. Sirius\nD. Vega\nAnswer:"]


def load_golden() -> dict:
    with open(GOLDEN) as f:
        return json.load(f)


def write_golden_data(golden: dict, root: str) -> dict:
    os.makedirs(root, exist_ok=True)
    paths = {}
    for name, rows in (("dev", golden["dev"]), ("test_0", golden["sets"]["0"]["questions"]),
                       ("test_5", golden["sets"]["5"]["questions"]),
                       ("subset", golden["sets"]["5"]["questions"])):   # subjects with dev questions
        paths[name] = os.path.join(root, f"{name}.jsonl")
        with open(paths[name], "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    return paths


def _logits(hf_path: str, layouts: list[dict]) -> dict:
    import torch

    from launcher.megatron.dist import init_distributed
    from launcher.megatron.forward import forward_logits
    from launcher.megatron.hf_io import import_hf_weights
    from launcher.megatron.models import build_model, unwrap_model
    from launcher.topology import ParallelDims
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hf_path)
    enc = [tok.encode(p) for p in PROMPTS]
    tokens = torch.full((len(enc), max(map(len, enc))), tok.pad_token_id, dtype=torch.long)
    for i, e in enumerate(enc):
        tokens[i, : len(e)] = torch.tensor(e)
    ref = None   # transformers' logits, computed only on ranks that hold Megatron's
    out = {}
    for layout in layouts:
        dims = ParallelDims(world_size=int(os.environ["WORLD_SIZE"]), **layout)
        init_distributed(dims, "cpu", timeout_s=120, seed=1234)
        model = build_model(hf_path, dims, "cpu", "float32", "alltoall")
        import_hf_weights(model, hf_path, "float32")
        inner = unwrap_model(model)
        logits = forward_logits(model, tokens)
        key = "_".join(f"{k}{v}" for k, v in layout.items())
        r = {"shared_output": bool(inner.share_embeddings_and_output_weights)}
        if inner.post_process and not inner.pre_process:   # the last stage's copy of the tied embedding
            import torch.distributed as dist

            w = inner.shared_embedding_or_output_weight().detach()
            r["copy_equals_hf_embedding"] = bool(torch.equal(w, _hf_embedding(hf_path, dims.tp, dist.get_rank())))
        if logits is not None:
            if ref is None:
                with torch.no_grad():
                    ref = AutoModelForCausalLM.from_pretrained(hf_path, dtype=torch.float32).eval()(tokens).logits
            r["last"] = max(float((logits[i, len(e) - 1] - ref[i, len(e) - 1]).abs().max()) for i, e in enumerate(enc))
            r["real"] = max(float((logits[i, : len(e)] - ref[i, : len(e)]).abs().max()) for i, e in enumerate(enc))
        out[key] = r
    return out


def _hf_embedding(hf_path: str, tp: int, rank: int):
    from safetensors.torch import load_file

    w = load_file(os.path.join(hf_path, "model.safetensors"))["model.embed_tokens.weight"]
    return w.chunk(tp)[rank % tp] if tp > 1 else w


def layouts_worker(hf_path: str, logit_layouts: list[dict], stage_layout: dict | None = None,
                   runs: list[dict] = ()) -> dict:
    """Logits at ``logit_layouts``; then the mmlu stage once per entry of ``runs`` at ``stage_layout``."""
    from omegaconf import OmegaConf

    from launcher.schema import MmluStage
    from launcher.megatron.dist import init_distributed, shutdown
    from launcher.stages import mmlu as stage
    from launcher.stages.context import StageContext, StageFailed
    from launcher.topology import ParallelDims

    import inspect

    from megatron.core.models.common.language_module.language_module import LanguageModule

    out = {"logits": _logits(hf_path, logit_layouts), "runs": [],
           # canary: the unpatched upstream method still copies the tied embedding with .cuda()
           "upstream_cuda_copy": "weight.data.cuda()" in inspect.getsource(
               LanguageModule.setup_embeddings_and_output_layer.__wrapped__)}
    if runs:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        dims = ParallelDims(world_size=world, **stage_layout)
        init_distributed(dims, "cpu", timeout_s=120, seed=1234)
        for r in runs:
            mmlu = OmegaConf.merge(OmegaConf.structured(MmluStage),
                                   {"parallel": stage_layout, "batch_size": 8, "max_batch_tokens": 4096, **r["mmlu"]})
            cfg = OmegaConf.create({"model": {"path": hf_path, "trust_remote_code": False},
                                    "stages": {"quantize": {"enabled": False, "dtype": "float32"}, "mmlu": mmlu}})
            try:
                stage.run(StageContext("mmlu", cfg, r["run_dir"], rank, world, rank, dims, "cpu"))
                out["runs"].append({"code": 0})
            except StageFailed as e:
                out["runs"].append({"code": e.exit_code, "error": str(e)})
    shutdown()
    return out


def _centered(xs):
    m = sum(xs) / len(xs)
    return [x - m for x in xs]


def _results(run_dir: str) -> dict:
    with open(os.path.join(run_dir, "mmlu", "results.json")) as f:
        return json.load(f)


def assert_matches_lm_eval(doc: dict, golden_set: dict) -> None:
    """Question by question: our prediction == lm-eval's, per-choice scores (centered) within 1e-3."""
    lm = golden_set["lm_eval"]
    assert len(doc["questions"]) == len(lm) == len(golden_set["questions"])
    worst = 0.0
    for i, (q, ref, src) in enumerate(zip(doc["questions"], lm, golden_set["questions"])):
        assert q["subject"] == src["subject"] and q["answer"] == "ABCD"[src["answer"]], i
        top = sorted(ref["loglikelihoods"], reverse=True)
        if top[0] - top[1] > TIE_MARGIN:   # a near-tie may flip on fp32 noise; its scores are still checked
            assert q["prediction"] == "ABCD"[ref["prediction"]], (i, q, ref)
        worst = max(worst, max(abs(a - b) for a, b in zip(_centered(q["logits"]), _centered(ref["loglikelihoods"]))))
    assert worst < SCORE_TOLERANCE, worst
    print(f"\n{golden_set['few_shots']}-shot: {len(lm)} questions equal lm-eval's predictions; "
          f"max centered score difference {worst:.2e}")


@pytest.fixture(scope="module")
def tp3_job(smollm2_dir, tmp_path_factory):
    golden = load_golden()
    root = tmp_path_factory.mktemp("smollm2_tp3")
    data = write_golden_data(golden, str(root / "data"))
    cache = str(root / "baseline_cache")
    runs = {
        "zero": {"dataset": data["test_0"], "few_shots": 0},
        "five": {"dataset": data["test_5"], "dev_dataset": data["dev"], "few_shots": 5},
        "evaluate": {"dataset": data["subset"], "baseline": "evaluate", "max_drop": 0.0, "baseline_cache_dir": cache},
        "cached": {"dataset": data["subset"], "baseline": "cached", "max_drop": 0.0, "baseline_cache_dir": cache},
        "cached_miss": {"dataset": data["subset"], "dev_dataset": data["dev"], "few_shots": 5, "baseline": "cached",
                        "max_drop": 0.0, "baseline_cache_dir": cache},
    }
    entries = [{"run_dir": str(root / name), "mmlu": over} for name, over in runs.items()]
    results = run_on_ranks("test_smollm2_layouts:layouts_worker", nprocs=3, timeout_s=900,
                           kwargs={"hf_path": smollm2_dir, "logit_layouts": [{"tp": 3}, {"pp": 3}],
                                   "stage_layout": {"tp": 3}, "runs": entries})
    return {"golden": golden, "root": root, "results": results, "names": list(runs), "cache": cache}


def test_logits_equal_transformers_at_tp3_and_pp3(tp3_job):
    res = [r["logits"] for r in tp3_job["results"]]
    for rank in range(3):   # TP3: every rank holds the (gathered) logits
        assert res[rank]["tp3"]["shared_output"] is True
        assert res[rank]["tp3"]["last"] < LAST_TOKEN_TOLERANCE and res[rank]["tp3"]["real"] < ALL_POSITIONS_TOLERANCE, res
    assert "last" not in res[0]["pp3"] and "last" not in res[1]["pp3"]
    assert res[2]["pp3"]["copy_equals_hf_embedding"] is True   # the shim's all-reduce copied it exactly
    assert res[2]["pp3"]["last"] < LAST_TOKEN_TOLERANCE and res[2]["pp3"]["real"] < ALL_POSITIONS_TOLERANCE, res


@pytest.mark.parametrize("shots,name", [("0", "zero"), ("5", "five")])
def test_gate_equals_lm_eval_harness(tp3_job, shots, name):
    assert tp3_job["results"][0]["runs"][tp3_job["names"].index(name)] == {"code": 0}
    doc = _results(str(tp3_job["root"] / name))
    assert doc["few_shots"] == int(shots)
    assert_matches_lm_eval(doc, tp3_job["golden"]["sets"][shots])


def test_baseline_evaluated_once_then_cached_then_refused_on_another_key(tp3_job):
    names, root = tp3_job["names"], tp3_job["root"]
    codes = [r["code"] for r in tp3_job["results"][0]["runs"]]
    assert codes[names.index("evaluate")] == 0 and codes[names.index("cached")] == 0
    first, second = _results(str(root / "evaluate")), _results(str(root / "cached"))
    assert first["baseline"]["source"] == "evaluated" and os.path.isfile(first["baseline"]["cache"])
    assert second["baseline"]["source"] == "cache" and second["baseline"]["cache"] == first["baseline"]["cache"]
    assert second["baseline"]["cache_key"] == first["baseline"]["cache_key"]
    # the same weights at the same layout: the cached baseline is the evaluation, bit for bit
    assert [q["baseline_logits"] for q in second["questions"]] == [q["logits"] for q in second["questions"]]
    paired = second["baseline"]["paired"]
    assert (paired["n10"], paired["n01"], paired["drop"], paired["interval"], paired["agreement"]) == (0, 0, 0.0, [0.0, 0.0], 1.0)
    assert second["mean_kl"] == 0.0 and second["pass"] is True
    # baseline=cached with another key (5 shots): every rank fails before any forward, naming the field
    for rank_result in tp3_job["results"]:
        miss = rank_result["runs"][names.index("cached_miss")]
        assert miss["code"] == 1 and miss["error"].startswith("stages.mmlu.baseline='cached': no cached baseline in ")
        assert "differs in " in miss["error"] and "few_shots: cached 0 vs now 5" in miss["error"]
    assert not os.path.exists(root / "cached_miss" / "mmlu" / "results.json")


def test_logits_equal_transformers_at_pp2_dp2(smollm2_dir):
    results = run_on_ranks("test_smollm2_layouts:layouts_worker", nprocs=4, timeout_s=600,
                           kwargs={"hf_path": smollm2_dir, "logit_layouts": [{"pp": 2}]})
    res = [r["logits"]["pp2"] for r in results]
    assert [("last" in r) for r in res] == [False, False, True, True]   # pp rank 1 = ranks 2, 3 (dp 2)
    assert all(r["upstream_cuda_copy"] for r in results), (
        "megatron-core no longer copies the tied embedding with .cuda(): delete cpu_compat's tied_embeddings_pp shim")
    for r in res[2:]:
        assert r["copy_equals_hf_embedding"] is True
        assert r["last"] < LAST_TOKEN_TOLERANCE and r["real"] < ALL_POSITIONS_TOLERANCE, res


def test_layouts_that_do_not_divide_the_model_are_refused_before_start():
    import subprocess

    example = os.path.join(REPO_ROOT, "examples", "HuggingFaceTB", "SmolLM2-135M-Instruct", "megatron_lm_ptq.yaml")
    proc = subprocess.run([sys.executable, "-m", "launcher.cli", "validate", example, "stages.quantize.parallel.tp=2",
                           "stages.quantize.parallel.world_size=2", "stages.mmlu.parallel.pp=4",
                           "stages.mmlu.parallel.world_size=4"], cwd=REPO_ROOT, capture_output=True, text=True)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    err = proc.stderr
    assert "stages.quantize.parallel.tp=2: must divide model.num_attention_heads=9 (valid: 1, 3, 9)" in err
    assert "stages.quantize.parallel.tp=2: must divide model.num_query_groups=3 (valid: 1, 3)" in err
    assert ("stages.mmlu.parallel.pp=4: must divide model.num_layers=30 layers: Megatron gives every pipeline "
            "stage the same number of whole layers (valid: 1, 2, 3, 5, 6, 10, 15, 30)") in err
