"""The tiny Nemotron-H example end to end on 4 local gloo ranks (issue 14's done-when).

1. ``launch examples/tiny/NemotronH-MoE-tiny/megatron_lm_ptq.yaml`` as shipped: NVFP4 quantize at
   EP4 (the summary names the Mamba in_proj/out_proj, the experts, the shared experts and the
   attention linears, all weight-quantized), the gate at EP4 (balanced) >= 0.9, export at PP4
   verified - Mamba, expert, shared-expert and attention tensors bit-exact against the Megatron
   model's fake-quantized weights, and hf_quant_config.json excluding exactly the unquantized
   modules (conv1d, routers, embedding, lm_head); the vLLM smoke records vLLM's own refusal.
2. recipe=none, quantize disabled (export imports the HF weights), export at PP4: the export loads
   in transformers and gives the original checkpoint's logits, bit for bit.
"""
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT

pytestmark = pytest.mark.slow
EXAMPLE = os.path.join(ROOT, "examples", "tiny", "NemotronH-MoE-tiny", "megatron_lm_ptq.yaml")


@pytest.fixture(scope="session")
def tiny_nemotron_h_dir():
    pytest.importorskip("torch")
    from launcher_testing.tiny import NEMOTRON_H_NAME, ensure_tiny_model

    return str(ensure_tiny_model(name=NEMOTRON_H_NAME))


def launch(*args):
    out = subprocess.run([sys.executable, "-m", "launcher.cli", EXAMPLE, *args], cwd=ROOT, capture_output=True,
                         text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=1500)
    text = out.stdout + out.stderr
    run_dir = text.split("[launch] run directory: ")[1].split("\n")[0].strip()
    return out.returncode, text, run_dir


def load(run_dir, *parts):
    with open(os.path.join(run_dir, *parts)) as f:
        return json.load(f)


def test_tiny_nemotron_h_nvfp4_pipeline(tmp_path, tiny_nemotron_h_dir):
    code, out, run_dir = launch(f"runs_root={tmp_path}")
    assert code == 0, out[-6000:]
    meta = load(run_dir, "metadata.json")
    assert [meta["stages"][s]["status"] for s in ("quantize", "mmlu", "export", "vllm_smoke")] == [
        "completed", "completed", "completed", "skipped"], meta["stages"]
    assert "is_act_and_mul=False is supported only for CUDA" in meta["stages"]["vllm_smoke"]["reason"]

    summary = load(run_dir, "quantize", "summary.json")
    assert summary["layout"]["ep"] == 4 and summary["model"]["architecture"] == "NemotronHForCausalLM"
    named = summary["summary"]["weight_quantized_by_name"]
    assert named["mamba"] == {"decoder.layers.*.mixer.in_proj": [4, 4], "decoder.layers.*.mixer.out_proj": [4, 4]}
    assert named["experts"] == {"decoder.layers.*.mlp.experts.local_experts.*.linear_fc1": [24, 24],
                                "decoder.layers.*.mlp.experts.local_experts.*.linear_fc2": [24, 24]}
    assert named["shared_experts"] == {"decoder.layers.*.mlp.shared_experts.linear_fc1": [3, 3],
                                       "decoder.layers.*.mlp.shared_experts.linear_fc2": [3, 3]}
    assert named["attention"] == {"decoder.layers.*.self_attention.linear_proj": [1, 1],
                                  "decoder.layers.*.self_attention.linear_qkv": [1, 1]}
    assert named["router"] == {"decoder.layers.*.mlp.router": [0, 3]}
    assert summary["summary"]["unquantized_expert_linears"] == [] and summary["checks"]["passed"]
    assert summary["summary"]["enabled_by_format"] == {"nvfp4": summary["summary"]["quantizers_enabled"]}

    results = load(run_dir, "mmlu", "results.json")
    assert results["pass"] is True and results["accuracy"] >= 0.9, results["accuracy"]
    assert results["n"] == 320
    assert results["shard_mode"] == "balanced" and results["plan"]["n_shards"] == 4    # EP4, not lockstep
    assert results["plan"]["forward_calls_per_rank"] == [5, 5, 5, 5]

    verify = load(run_dir, "export", "verify.json")
    assert verify["ok"] is True, verify["errors"]
    checks = verify["checks"]
    assert checks["layers"] == {"num_layers": 8, "num_experts": 8, "moe_layers": 3}
    by_kind = checks["dequant_vs_megatron"]["by_kind"]
    assert set(by_kind) == {"mamba", "expert", "shared_expert", "attention"}, by_kind
    assert all(v["bit_exact"] == v["modules"] > 0 and v["flips"] == 0 for v in by_kind.values()), by_kind
    excludes = checks["quant_config"]["exclude_modules"]
    mamba_layers = [i for i, c in enumerate("MEM*EMEM") if c == "M"]
    moe_layers = [i for i, c in enumerate("MEM*EMEM") if c == "E"]
    assert sorted(excludes) == sorted(["backbone.embeddings", "lm_head"]
                                      + [f"backbone.layers.{i}.mixer.conv1d" for i in mamba_layers]
                                      + [f"backbone.layers.{i}.mixer.gate" for i in moe_layers])
    assert checks["names_vs_source"]["missing"] == 0 and checks["names_vs_source"]["extra"] == 0


def test_tiny_nemotron_h_none_export_round_trips_through_transformers(tmp_path, tiny_nemotron_h_dir):
    import torch
    import transformers

    code, out, run_dir = launch(f"runs_root={tmp_path}", "recipe=none", "stages.quantize.enabled=false",
                                "stages.mmlu.enabled=false", "stages.vllm_smoke.enabled=false")
    assert code == 0, out[-6000:]
    assert load(run_dir, "export", "verify.json")["ok"] is True
    tokens = torch.randint(0, 600, (2, 40), generator=torch.Generator().manual_seed(0))
    logits = []
    for path in (os.path.join(tiny_nemotron_h_dir, "hf"), os.path.join(run_dir, "export", "hf")):
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        with torch.no_grad():
            logits.append(model(tokens, use_cache=False).logits)
    assert torch.equal(logits[0], logits[1])
