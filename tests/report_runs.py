"""Synthetic run directories for the `launch report` tests, written by the product's own writers:
RunDirectory (config.yaml, metadata.json), launcher.mmlu.results.decide + build_results
(mmlu/results.json, with a paired baseline), the export stage's verify.json fields, and
vllm_smoke's SmokeRecord (responses.json) or skip.json.  No torch, no pipeline run.

A run's gate is given by counts on n questions (every answer is "A"): the baseline gets the
first ``baseline_correct`` right; the quantized model loses ``n10`` of those and gains ``n01``
of the others, so its accuracy is (baseline_correct - n10 + n01) / n and the paired drop is
(n10 - n01) / n.
"""
from __future__ import annotations

import copy
import functools
import os
from dataclasses import asdict
from types import SimpleNamespace
from typing import Optional

from launcher.config.compose import compose_example
from launcher.contract import RunLayout, StageName, StageStatus, write_json_atomic, write_text_atomic
from launcher.rundir import RunDirectory

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_EXAMPLE = os.path.join(ROOT, "examples", "tiny", "Qwen3-MoE-tiny", "megatron_lm_ptq.yaml")
STAGES = ("quantize", "mmlu", "export", "vllm_smoke")


def _logits(pred: int, sharp: float) -> list[float]:
    out = [0.0, 0.0, 0.0, 0.0]
    out[pred] = sharp
    return out


def gate_results(n: int, baseline_correct: int, n10: int, n01: int, lower_bound: Optional[float],
                 max_drop: Optional[float], sharp: float = 2.0) -> dict:
    """mmlu/results.json as the gate writes it (launcher.mmlu.results.build_results)."""
    from launcher.mmlu.results import build_results, decide

    assert 0 <= n10 <= baseline_correct and 0 <= n01 <= n - baseline_correct
    base_pred = [0 if i < baseline_correct else 1 for i in range(n)]
    pred = list(base_pred)
    for i in range(n10):
        pred[i] = 1
    for i in range(baseline_correct, baseline_correct + n01):
        pred[i] = 0
    subjects = ["abstract_algebra", "anatomy", "astronomy", "virology"]
    prompts = [SimpleNamespace(question=SimpleNamespace(index=i, subject=subjects[i % 4], answer=0), text=f"q{i}")
               for i in range(n)]
    prepared = SimpleNamespace(prompts=prompts, batches=[], truncated=0, limits=None)
    results = {i: (pred[i], _logits(pred[i], sharp)) for i in range(n)}
    baseline = {i: (base_pred[i], _logits(base_pred[i], 2.0)) for i in range(n)}
    scfg = SimpleNamespace(baseline="evaluate" if max_drop is not None else "none", lower_bound=lower_bound,
                           max_drop=max_drop, baseline_accuracy=None, dataset="synthetic/mmlu", dev_dataset=None,
                           fraction=1.0, few_shots=0, add_bos=False, batch_size=16, max_batch_tokens=4096)
    plan = SimpleNamespace(mode="balanced", summary=lambda: {"steps": 5}, shard_padded_tokens=lambda: None)
    decision = decide(prepared, results, scfg, baseline if max_drop is not None else None)
    return build_results(prepared, results, scfg, decision, plan,
                         baseline if max_drop is not None else None, {"eval_s": 1.0})


@functools.lru_cache(maxsize=None)
def _composed(overrides: tuple):
    return compose_example(TINY_EXAMPLE, list(overrides))


def compose_tiny(runs_root: str, overrides: tuple = ()):
    """The tiny example composed with ``overrides`` (once per overrides: Hydra is slow), at ``runs_root``."""
    cfg = copy.deepcopy(_composed(tuple(overrides)))
    cfg.runs_root = runs_root
    return cfg


def make_run(runs_root: str, run_id: str, created: str, *, job_name: str = "tiny-qwen3-moe-nvfp4",
             recipe: str = "nvfp4_default", n: int = 320, baseline_correct: int = 310, n10: int = 4,
             n01: int = 1, lower_bound: float = 0.85, max_drop: Optional[float] = 0.05, sharp: float = 2.0,
             seconds: tuple = (60.0, 45.0, 30.0, 5.0), size_ratio: float = 0.36,
             vllm: str = "skip", interrupted_in: Optional[str] = None, cfg=None) -> str:
    """One run directory; returns its path.  The gate fails when the counts fall below its
    bounds (export and vllm_smoke are then not run); ``interrupted_in``: that stage was running
    when the launcher died (later stages pending, no final status)."""
    cfg = cfg or compose_tiny(runs_root, (f"job_name={job_name}", f"recipe={recipe}"))
    run = RunDirectory.create(cfg, run_id=run_id)
    run.update_run(created=created, status=StageStatus.RUNNING, started=0)
    layout = RunLayout(run.path)
    for stage, secs in zip(STAGES, seconds):
        if stage == interrupted_in:
            run.update_stage(stage, status=StageStatus.RUNNING)
            write_text_atomic(layout.log(stage), f"[{stage} r0] started\n")
            return run.path
        run.update_stage(stage, status=StageStatus.RUNNING)
        if stage == StageName.MMLU:
            doc = gate_results(n, baseline_correct, n10, n01, lower_bound, max_drop, sharp)
            write_json_atomic(layout.mmlu_results, doc)
            if not doc["pass"]:
                msg = "MMLU gate failed: " + "; ".join(doc["failures"])
                write_text_atomic(layout.log(stage), "".join(f"[mmlu r{r}] STAGE FAILED: {msg}\n" for r in range(4)))
                run.update_stage(stage, status=StageStatus.FAILED, duration_s=secs, exit_code=3, state="FAILED",
                                 reason="gate failed (accuracy below the bound)")
                for later in STAGES[STAGES.index(stage) + 1:]:
                    run.update_stage(later, status=StageStatus.NOT_RUN, reason="mmlu failed")
                run.update_run(status=StageStatus.FAILED, ended=1, exit_code=3)
                return run.path
        if stage == StageName.EXPORT:
            write_json_atomic(layout.export_verify, {
                "ok": True, "errors": [], "warnings": [], "export_dir": layout.export_dir("hf"),
                "size": {"export_bytes": int(size_ratio * 1e7), "bf16_bytes": int(1e7), "source_bytes": None,
                         "params": int(5e6), "ratio_vs_bf16": size_ratio}})
        if stage == StageName.VLLM_SMOKE:
            if vllm == "skip":
                write_json_atomic(layout.skip(stage), {"reason": "NVFP4 needs a Blackwell GPU; this machine has none"})
                run.update_stage(stage, status=StageStatus.SKIPPED, duration_s=secs,
                                 reason="NVFP4 needs a Blackwell GPU; this machine has none")
                continue
            from launcher.stages.vllm_smoke import SmokeRecord

            rec = SmokeRecord(mode="offline", model_dir=layout.export_dir("hf"), capability={"supported": True},
                              criteria={"min_agreement": 0.95, "min_accuracy": lower_bound, "tie_margin": 0.25},
                              passed=True, agreement=0.99, accuracy=0.95)
            write_json_atomic(layout.vllm_responses, asdict(rec))
        run.update_stage(stage, status=StageStatus.COMPLETED, duration_s=secs, exit_code=0, state="COMPLETED")
    run.update_run(status=StageStatus.COMPLETED, ended=1, exit_code=0)
    return run.path
