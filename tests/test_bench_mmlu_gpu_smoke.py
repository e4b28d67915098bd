"""CPU smoke run of benchmarks/mmlu_gpu.py (the H200 benchmark's code path, tiny widths).

It runs every configuration the GPU run measures - product default and sweep, the old default,
kernel and expert-loop ablations, NVFP4 and FP8 gates folded and unfolded, megatron_mmlu at
batch 1 and 4 - on the tiny model's tokenizer and MMLU-format questions, and must exit 0.  On
CPU the gate's fast paths are bit-exact, so the JSON must say so: grouped experts == the expert
loop, folded + grouped quantized gate == unfolded loop, logits bit for bit.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_mmlu_gpu_benchmark_cpu_smoke(tiny_dir, tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "mmlu_gpu.py"), "--device", "cpu", "--small",
           "--dataset", os.path.join(tiny_dir, "mmlu", "test.jsonl"), "--tokenizer", os.path.join(tiny_dir, "hf"),
           "--mmlu-hf", str(tmp_path / "mmlu_hf"), "--fraction", "0.1", "--moe-fraction", "0.1",
           "--budgets", "2048", "--ref-batch-sizes", "1,4", "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    doc = json.loads((out / "mmlu_gpu.json").read_text())
    assert doc["failed"] == [] and [r["model"] for r in doc["results"]] == ["dense", "moe"]
    for r in doc["results"]:
        runs = {o["config"] for o in r["ours"]}
        assert {"old_default", "default", "budget:2048", "256:16384", "local_kernels",
                "nvfp4_unfolded", "nvfp4", "fp8_unfolded", "fp8"} <= runs, runs
        assert [x["batch_size"] for x in r["reference"]] == [1, 4]
        assert (r["cache_cold"], r["cache_warm"]) == ("miss", "hit")
        assert r["default_limits"]["source"] == "auto-cpu" and r["default_limits"]["rows"] == 8
        a = r["agreement"]
        # the fold is the exporter's arithmetic (launcher.megatron.fold): NVFP4 on CPU is the fake
        # quant bit for bit; FP8 is code * scale where the fake quant divides by 448/amax (ulps)
        def fold_unchanged(fmt, key):
            return a[key]["bit_identical"] if fmt == "nvfp4" else a[key]["changed_clear"] == 0

        for fmt in ("nvfp4", "fp8"):
            assert fold_unchanged(fmt, f"{fmt}_folded_grouped_vs_unfolded_loop"), (r["model"], fmt, a)
            assert r["quantized"][fmt]["folded_weight_quantizers"] > 0
        if r["model"] == "moe":
            assert "expert_loop" in runs and a["grouped_vs_expert_loop"]["bit_identical"], a
            for fmt in ("nvfp4", "fp8"):
                assert fold_unchanged(fmt, f"{fmt}_fold_only") and a[f"{fmt}_grouping_only"]["bit_identical"], a
            assert r["quantized"]["nvfp4"]["fold"]["grouped_expert_layers"] == 2
        assert a["default_vs_local_kernels"]["changed_clear"] == 0       # SDPA: < 1e-5 on CPU
        assert set(r["targets"]) >= {"default_within_1.2x_best", "prepare_warm_le_10pct_eval"}
        assert {p["config"] for p in r["profiles"]} >= {"default", "local_kernels", "nvfp4", "fp8"}
    assert "### moe" in p.stdout and "megatron_mmlu bs=1" in p.stdout
