"""MMLU evaluation on real Megatron-Core + gloo ranks (CPU).

One 4-rank run evaluates a tiny Qwen3-MoE checkpoint at EP4 (balanced alltoall, lockstep,
balanced allgather, then the pre-fix dense_dp mode that the guard must stop), EP2 x EDP2,
TP2 x EP2, PP2 and dense DP4; every mode's predictions must equal transformers' (a single-rank,
unsharded evaluation) question by question.  A second 4-rank run executes the stage itself
(results.json, gate pass) and then the gate failing: every rank exits EXIT_GATE_FAILED.
"""
from __future__ import annotations

import csv
import json
import os
import sys
import time

import pytest

from launcher_testing.checkpoints import write_tiny_qwen3_moe
from launcher_testing.ranks import RanksFailed, run_on_ranks

SUBJECTS = ("astronomy", "world_religions")
N_PER_SUBJECT = 13


def write_fixture_csv(root: str) -> str:
    """A CSV dir (data/{dev,test}/<subject>_{split}.csv) with questions of varied length."""
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
    for split, n in (("test", N_PER_SUBJECT), ("dev", 2)):
        d = os.path.join(root, "data", split)
        os.makedirs(d, exist_ok=True)
        for s_i, subject in enumerate(SUBJECTS):
            with open(os.path.join(d, f"{subject}_{split}.csv"), "w", newline="") as f:
                w = csv.writer(f)
                for i in range(n):
                    q = f"{split} q{i} about " + " ".join(words[: 1 + (i * 5 + s_i * 3) % 12]) + "?"
                    choices = [f"{words[(i + k) % 12]} {k}" for k in range(4)]
                    w.writerow([q, *choices, "ABCD"[(i + s_i) % 4]])
    return root


def mmlu_cfg(dataset: str, **over):
    from omegaconf import OmegaConf

    from launcher.schema import MmluStage

    return OmegaConf.merge(OmegaConf.structured(MmluStage(dataset=dataset)),
                           {"few_shots": 1, "batch_size": 2, **over})


# ----------------------------------------------------------------------------- rank workers

def eval_worker(hf_path: str, data_dir: str, cases: list[dict]) -> dict:
    from launcher.megatron.dist import init_distributed, shutdown
    from launcher.megatron.hf_io import import_hf_weights
    from launcher.megatron.models import build_model
    from launcher.mmlu.evaluate import evaluate_model
    from launcher.mmlu.guard import DesyncError
    from launcher.mmlu.prepared import load_tokenizer, prepare
    from launcher.topology import ParallelDims

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    prepared = prepare(mmlu_cfg(data_dir), load_tokenizer(hf_path))
    out: dict = {}
    for case in cases:
        dims = ParallelDims(world_size=world, **case["layout"])
        init_distributed(dims, "cpu", timeout_s=120, seed=1234)
        model = build_model(hf_path, dims, "cpu", "float32", case["dispatcher"])
        import_hf_weights(model, hf_path, "float32")
        cache: dict = {}
        for mode in case["modes"]:
            key = "_".join(f"{k}{v}" for k, v in case["layout"].items()) or "dp4"
            key = f"{key}/{mode}/{case['dispatcher']}"
            t = time.time()
            try:
                res, plan, run = evaluate_model(model, prepared, dims, rank, mode, case["dispatcher"],
                                                timeout_s=45, allow_unsafe=True, label=key,
                                                groups_cache=cache)
            except DesyncError as e:
                out[key] = {"error": str(e), "exit_code": e.exit_code, "seconds": time.time() - t}
                continue
            out[key] = {"forward_calls": run.forward_calls, "dummies": run.dummies,
                        "seconds": time.time() - t, "plan_calls": plan.forward_calls()}
            if res is not None:
                out[key]["predictions"] = [res[i][0] for i in range(len(prepared.prompts))]
                out[key]["logits"] = [res[i][1] for i in range(len(prepared.prompts))]
        if case.get("guard_probe"):
            out["guard_probe"] = guard_probe(rank, world)
    shutdown()
    return out


def guard_probe(rank: int, world: int) -> dict:
    """Allgather shape mismatch at step 1 -> every rank raises; then a peer that never arrives."""
    import datetime

    import torch.distributed as dist

    from launcher.mmlu.guard import DesyncError, StepGuard, make_groups
    from launcher.mmlu.sharding import plan_shards
    from launcher.topology import ParallelDims

    plan = plan_shards([(2, 10)] * 8, ParallelDims(world, ep=world), "balanced", "allgather")
    guard = StepGuard(plan, rank, make_groups(plan, 45), label="probe")
    res = {}
    try:
        guard.check(0, 2, 10, 2)
        guard.check(1, 2, 11 if rank == 2 else 10, 2)
        res["shape"] = "no error"
    except DesyncError as e:
        res["shape"] = str(e)
    # a peer that never reaches the guard: the others fail after the guard timeout
    group = dist.new_group(ranks=list(range(world)), timeout=datetime.timedelta(seconds=4),
                           backend="gloo")
    missing = StepGuard(plan, rank, {0: group}, timeout_s=4, label="probe")
    t = time.time()
    if rank != world - 1:
        try:
            missing.check(0, 2, 10, 2)
            res["missing"] = "no error"
        except DesyncError as e:
            res["missing"] = str(e)
    res["missing_seconds"] = time.time() - t
    return res


def quantize_fp8(hf_path: str, data_dir: str, dims, path: str) -> None:
    """A quantized checkpoint like the quantize stage's: FP8_DEFAULT_CFG, calibrated on 2 batches."""
    import modelopt.torch.quantization as mtq
    import torch

    from launcher.megatron.checkpoint import save_checkpoint
    from launcher.megatron.forward import forward_logits
    from launcher.megatron.hf_io import import_hf_weights
    from launcher.megatron.models import build_model, unwrap_model
    from launcher.mmlu.prepared import load_tokenizer, prepare

    prepared = prepare(mmlu_cfg(data_dir), load_tokenizer(hf_path))
    model = build_model(hf_path, dims, "cpu", "float32", "alltoall")
    import_hf_weights(model, hf_path, "float32")

    def loop(m):
        for b in prepared.batches[:2]:
            tokens = torch.zeros(b.shape, dtype=torch.long)
            for row, p in enumerate(b.items):
                tokens[row, : len(prepared.token_ids[p])] = torch.tensor(prepared.token_ids[p])
            forward_logits(m, tokens)

    mtq.quantize(unwrap_model(model), mtq.FP8_DEFAULT_CFG, loop)
    save_checkpoint(model, path)


def stage_worker(hf_path: str, data_dir: str, runs: list[dict], layout: dict) -> None:
    """Run launcher.stages.mmlu.run once per entry of ``runs``; exit with the last one's code."""
    from omegaconf import OmegaConf

    from launcher.megatron.dist import init_distributed, shutdown
    from launcher.stages import mmlu as stage
    from launcher.stages.context import StageContext, StageFailed
    from launcher.topology import ParallelDims

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dims = ParallelDims(world_size=world, **layout)
    init_distributed(dims, "cpu", timeout_s=120, seed=1234)
    code = 0
    for r in runs:
        if r.get("quantize"):
            quantize_fp8(hf_path, data_dir, dims, os.path.join(r["run_dir"], "quantize", "checkpoint"))
        cfg = OmegaConf.create({
            "model": {"path": hf_path, "trust_remote_code": False},
            "stages": {"quantize": {"enabled": bool(r.get("quantize")), "dtype": "bfloat16"},
                       "mmlu": mmlu_cfg(data_dir, parallel=layout, **r["mmlu"])}})
        ctx = StageContext("mmlu", cfg, r["run_dir"], rank, world, rank, dims, "cpu")
        try:
            stage.run(ctx)
            code = 0
        except StageFailed as e:
            print(f"rank {rank}: StageFailed({e.exit_code}): {e}", flush=True)
            code = e.exit_code
    shutdown()
    sys.exit(code)


# ----------------------------------------------------------------------------- tests

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("mmlu_dist")
    hf = write_tiny_qwen3_moe(str(root / "hf"), num_layers=2)
    data = write_fixture_csv(str(root / "mmlu"))
    return {"hf": hf, "data": data, "root": root}


@pytest.fixture(scope="module")
def ref(tiny):
    return reference(tiny["hf"], tiny["data"])


def reference(hf: str, data: str, **over):
    """transformers, one prompt at a time, no padding: the single-rank unsharded answer."""
    import torch
    import transformers

    from launcher.mmlu.prepared import load_tokenizer, prepare

    prepared = prepare(mmlu_cfg(data, **over), load_tokenizer(hf))
    model = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    preds, logits = [], []
    with torch.no_grad():
        for ids in prepared.token_ids:
            last = model(torch.tensor([ids])).logits[0, -1, prepared.choice_ids]
            preds.append(int(last.argmax()))
            logits.append(last.tolist())
    return prepared, preds, logits


CASES = [
    {"layout": {"ep": 4}, "dispatcher": "alltoall", "modes": ["balanced", "lockstep", "dense_dp"],
     "guard_probe": True},
    {"layout": {"ep": 4}, "dispatcher": "allgather", "modes": ["auto"]},
    {"layout": {"ep": 2}, "dispatcher": "alltoall", "modes": ["balanced", "lockstep"]},
    {"layout": {"tp": 2, "ep": 2}, "dispatcher": "alltoall", "modes": ["balanced"]},
    {"layout": {"pp": 2}, "dispatcher": "alltoall", "modes": ["balanced"]},
    {"layout": {}, "dispatcher": "alltoall", "modes": ["balanced", "dense_dp"]},
]


@pytest.mark.slow
def test_modes_and_layouts_match_single_rank(tiny, ref):
    prepared, ref_preds, ref_logits = ref
    n_batches = len(prepared.batches)
    assert len(prepared.prompts) == 26 and n_batches == 13
    t = time.time()
    results = run_on_ranks("test_mmlu_distributed:eval_worker", nprocs=4, timeout_s=420,
                           kwargs={"hf_path": tiny["hf"], "data_dir": tiny["data"], "cases": CASES})
    wall = time.time() - t
    r0 = results[0]
    evaluated = [k for k, v in r0.items() if k != "guard_probe" and "predictions" in v]
    assert sorted(evaluated) == sorted([
        "ep4/balanced/alltoall", "ep4/lockstep/alltoall", "ep4/auto/allgather",
        "ep2/balanced/alltoall", "ep2/lockstep/alltoall", "tp2_ep2/balanced/alltoall",
        "pp2/balanced/alltoall", "dp4/balanced/alltoall", "dp4/dense_dp/alltoall"])
    for key in evaluated:
        assert r0[key]["predictions"] == ref_preds, key
        diff = max(abs(a - b) for la, lb in zip(r0[key]["logits"], ref_logits) for a, b in zip(la, lb))
        assert diff < 1e-4, (key, diff)
    calls = {k: [r[k]["forward_calls"] for r in results] for k in evaluated}
    # balanced: 13 batches dealt in snake order over 4 DP ranks (3,3,3,4) -> 4 forwards each;
    # lockstep at EP4: all 13 on every rank
    assert calls["ep4/balanced/alltoall"] == [4, 4, 4, 4]
    assert [r["ep4/balanced/alltoall"]["dummies"] for r in results] == [1, 1, 1, 0]
    assert calls["ep4/lockstep/alltoall"] == [13, 13, 13, 13]
    assert calls["ep4/auto/allgather"] == [4, 4, 4, 4]
    assert calls["ep2/balanced/alltoall"] == [3, 3, 4, 4]
    assert calls["ep2/lockstep/alltoall"] == [7, 7, 6, 6]
    assert calls["tp2_ep2/balanced/alltoall"] == [7, 7, 6, 6]
    assert calls["pp2/balanced/alltoall"] == [7, 6, 7, 6]
    assert calls["dp4/balanced/alltoall"] == [3, 3, 3, 4]
    assert calls["dp4/dense_dp/alltoall"] == [4, 3, 3, 3]
    # the seed bug at EP4: the guard stops it at the first forward on every rank, with one message
    bug = [r["ep4/dense_dp/alltoall"] for r in results]
    assert [b["exit_code"] for b in bug] == [4, 4, 4, 4]
    assert all(b["seconds"] < 60 for b in bug), [b["seconds"] for b in bug]
    msg = bug[0]["error"]
    assert msg.startswith("mmlu [ep4/dense_dp/alltoall]: desync guard tripped before forward 0 "
                          "(shard_mode=dense_dp, dispatcher=alltoall): ranks disagree on the number "
                          "of forward steps. Ranks [0, 1, 2, 3]: "), msg
    assert "rank 0: step 0/4 steps, shape " in msg and "rank 3: step 0/3 steps, shape " in msg
    probe = [r["guard_probe"] for r in results]
    assert all("TP/PP" not in p["shape"] and "the EP group disagree on the padded batch shape"
               in p["shape"] and "rank 2: step 1/2 steps, shape 2x11" in p["shape"] for p in probe), probe
    for p in probe[:3]:
        assert "did not all reach guard call 1" in p["missing"] and "within 4 s" in p["missing"], p
        assert p["missing_seconds"] < 30
    print(f"\n4-rank eval run: {wall:.1f} s wall; forward calls per rank: {calls}")
    print("seconds per mode (rank 0):", {k: round(r0[k]["seconds"], 2) for k in evaluated})
    print("dense_dp guard error after", [round(b["seconds"], 3) for b in bug], "s")


def built_tiny_model():
    """launcher_testing.tiny's trained Qwen3-MoE-tiny when it is already built (building trains a model:
    minutes), else None."""
    try:
        from launcher_testing.tiny import ensure_tiny_model
        from launcher_testing.tiny.build import default_dir, is_current
        from launcher_testing.tiny.train import Recipe
    except ImportError:
        return None
    if not is_current(default_dir(), Recipe()):
        return None
    return ensure_tiny_model()


@pytest.fixture(scope="module")
def stage_model(tiny, ref):
    """The trained tiny model with its synthetic MMLU (10 % of it) when built (PTQ_CACHE_DIR picks
    the cache), else the random one."""
    build = built_tiny_model()
    if build is None:
        return {**tiny, "over": {}, "ref": ref, "subjects": sorted(SUBJECTS), "name": "random"}
    # zero-shot, like examples/tiny (the tiny model is trained for it)
    hf, data, over = str(build / "hf"), str(build / "mmlu"), {"fraction": 0.1, "few_shots": 0}
    from launcher_testing.tiny.synthetic_mmlu import SUBJECTS as TINY_SUBJECTS

    return {"hf": hf, "data": data, "root": tiny["root"], "over": over,
            "ref": reference(hf, data, **over), "subjects": sorted(TINY_SUBJECTS), "name": "tiny"}


@pytest.mark.slow
def test_stage_gate_pass_then_fail_exit_codes(stage_model):
    from launcher.mmlu.sharding import plan_shards
    from launcher.topology import ParallelDims

    m = stage_model
    root, over = m["root"], m["over"]
    prepared, ref_preds, _ = m["ref"]
    n = len(prepared.prompts)
    runs = [{"run_dir": str(root / "run_pass"), "quantize": True,
             "mmlu": {"lower_bound": 0.05, "baseline": "evaluate", "max_drop": 1.0,
                      "baseline_cache_dir": str(root / "baseline_cache"), **over}},
            {"run_dir": str(root / "run_fail"), "mmlu": {"lower_bound": 0.99, **over}}]
    t = time.time()
    with pytest.raises(RanksFailed) as e:
        run_on_ranks("test_mmlu_distributed:stage_worker", nprocs=4, timeout_s=300,
                     kwargs={"hf_path": m["hf"], "data_dir": m["data"], "runs": runs,
                             "layout": {"ep": 4}})
    wall = time.time() - t
    assert e.value.returncodes == [3, 3, 3, 3], str(e.value)[-3000:]
    for out in e.value.outputs:
        assert "StageFailed(3): MMLU gate failed: accuracy " in out and "< lower_bound 0.99" in out
    calls = plan_shards([b.shape for b in prepared.batches], ParallelDims(4, ep=4)).forward_calls()
    docs = {}
    for name, passed in (("run_pass", True), ("run_fail", False)):
        with open(root / name / "mmlu" / "results.json") as f:
            docs[name] = doc = json.load(f)
        assert doc["pass"] is passed
        assert doc["n"] == n and doc["shard_mode"] == "balanced"
        assert doc["correct"] == sum(q["correct"] for q in doc["questions"])
        assert doc["plan"]["forward_calls_per_rank"] == calls
        assert sorted(doc["per_subject"]) == m["subjects"]
        assert set(doc["questions"][0]) >= {"index", "subject", "answer", "prediction", "logits"}
        assert len(doc["questions"][0]["logits"]) == 4
        lo, hi = doc["interval"]
        assert lo <= doc["accuracy"] <= hi
    # quantize disabled: the HF weights themselves, equal to transformers question by question
    fail = docs["run_fail"]
    assert [q["prediction"] for q in fail["questions"]] == ["ABCD"[p] for p in ref_preds]
    assert fail["failures"] == [f"accuracy {fail['accuracy']:.4f} ({fail['correct']}/{n}) < lower_bound 0.99"]
    # quantized checkpoint + baseline=evaluate: the baseline is the unquantized model
    ok = docs["run_pass"]
    assert [q["baseline_prediction"] for q in ok["questions"]] == ["ABCD"[p] for p in ref_preds]
    base_acc = sum(q["baseline_prediction"] == q["answer"] for q in ok["questions"]) / n
    assert {k: ok["baseline"][k] for k in ("mode", "accuracy", "drop", "source")} == {
        "mode": "evaluate", "accuracy": base_acc, "drop": base_acc - ok["accuracy"], "source": "evaluated"}
    assert ok["baseline"]["paired"]["method"] == "mcnemar_exact" and os.path.isfile(ok["baseline"]["cache"])
    agree = sum(q["baseline_prediction"] == q["prediction"] for q in ok["questions"]) / n
    assert ok["agreement"] == agree
    changed = sum(q["logits"] != q["baseline_logits"] for q in ok["questions"])
    assert changed == n, "FP8 fake quantization changes every question's logits"
    print(f"\n{m['name']} model, n={n}: stage run {wall:.1f} s wall; HF accuracy {fail['accuracy']:.3f}; "
          f"FP8 accuracy {ok['accuracy']:.3f}, agreement with baseline {agree:.3f}; calls {calls}")
