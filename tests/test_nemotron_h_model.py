"""Nemotron-H (Mamba-2 + attention + MoE) built by Megatron-Core without TransformerEngine, on CPU.

* Megatron's HybridModel logits equal transformers' NemotronHForCausalLM at EP4 and PP2xEP2 on 4
  gloo ranks (fp32, < 1e-4), including the LM-head-at-positions path the gate uses.
* The Mamba scan runs over several chunks (chunk_size 8, sequence 21).  transformers 5.14's CPU
  (naive) Mamba path is wrong across chunk boundaries - its inter-chunk recurrence sums over the
  target chunk instead of the source chunk, 3e-4 off in float64 - so the reference is computed
  with one chunk (``chunk_size=128`` at load; the SSD result does not depend on the chunking),
  and a test pins the transformers defect so that a fixed transformers shows up here.
* mamba_ssm's CPU reference scan (cpu_compat) equals a sequential float64 recurrence.
* The builder refuses config.json options that Megatron would compute differently, naming the key.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from launcher_testing.checkpoints import hf_logits, write_tiny_nemotron_h
from launcher_testing.ranks import REPO_ROOT, run_on_ranks

needs_mamba_ssm = pytest.mark.skipif(importlib.util.find_spec("mamba_ssm") is None,
                                     reason="mamba_ssm is not installed (scripts/setup_venv.sh installs it)")
LOGITS_TOLERANCE = 1e-4          # fp32, max |megatron - transformers|
SEQ = 21                         # > 2 chunks of 8

pytestmark = pytest.mark.torch   # imports torch, Megatron or ModelOpt (in-process or in its ranks)
FRESH_RANKS = True   # hybrid ranks: the Mamba stub must precede mamba_mixer's first import (a pooled worker may have done it)


@pytest.fixture(scope="module")
def random_nemotron_h(tmp_path_factory):
    pytest.importorskip("torch")
    return write_tiny_nemotron_h(str(tmp_path_factory.mktemp("tiny_nemotron_h")), pattern="MEM*EMEM")


def logits_worker(hf_path: str, layouts: list[dict]) -> dict:
    import torch

    from launcher.megatron.dist import init_distributed, megatron_group_ranks, shutdown
    from launcher.megatron.forward import forward_logits
    from launcher.megatron.hf_io import import_hf_weights
    from launcher.megatron.models import build_model, unwrap_model
    from launcher.topology import ParallelDims

    rank = int(os.environ["RANK"])
    tokens = torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(3))
    reference = hf_logits(hf_path, tokens, chunk_size=128)
    positions = torch.tensor([SEQ - 1, 5])
    rows = torch.arange(2)
    out = {}
    for layout in layouts:
        dims = ParallelDims(world_size=int(os.environ["WORLD_SIZE"]), **layout)
        init_distributed(dims, "cpu", timeout_s=90, seed=1234, architecture="NemotronHForCausalLM")
        mismatched = [k for k, ranks in megatron_group_ranks().items() if ranks != dims.group_of(k, rank)]
        model = build_model(hf_path, dims, "cpu", "bfloat16", "alltoall")
        import_hf_weights(model, hf_path, "float32")
        inner = unwrap_model(model)
        logits = forward_logits(model, tokens)
        at = forward_logits(model, tokens, positions=positions)
        key = "_".join(f"{k}{v}" for k, v in layout.items())
        out[key] = {
            "model": type(inner).__name__,
            "layer_types": [type(layer).__name__ for layer in inner.decoder.layers],
            "final_norm": type(getattr(inner.decoder, "final_norm", None)).__name__,
            "max_abs_diff": None if logits is None else float((logits - reference).abs().max()),
            "positions_shape": None if at is None else list(at.shape),
            "positions_vs_transformers": None if at is None else float((at - reference[rows, positions]).abs().max()),
            "group_mismatch": mismatched,
        }
    shutdown()
    return out


@needs_mamba_ssm
@pytest.mark.slow
def test_nemotron_h_logits_match_transformers_ep4_and_pp2_ep2(random_nemotron_h):
    results = run_on_ranks("test_nemotron_h_model:logits_worker", nprocs=4, timeout_s=400,
                           kwargs={"hf_path": random_nemotron_h, "layouts": [{"ep": 4}, {"pp": 2, "ep": 2}]})
    for rank, per_layout in enumerate(results):
        for layout, r in per_layout.items():
            assert r["group_mismatch"] == [], (rank, layout, r)
            assert r["model"] == "HybridModel"
    # EP4: all 8 layers on every rank; PP2: layers 0-3 on pp rank 0 (ranks 0,1), 4-7 on ranks 2,3
    assert results[0]["ep4"]["layer_types"] == ["MambaLayer", "TransformerLayer", "MambaLayer", "TransformerLayer",
                                                "TransformerLayer", "MambaLayer", "TransformerLayer", "MambaLayer"]
    assert results[0]["pp2_ep2"]["layer_types"] == ["MambaLayer", "TransformerLayer", "MambaLayer", "TransformerLayer"]
    assert results[0]["ep4"]["final_norm"] == "RMSNorm"          # torch's, not TE's
    ep4 = [r["ep4"]["max_abs_diff"] for r in results]
    pp2 = [r["pp2_ep2"]["max_abs_diff"] for r in results]
    assert all(d is not None and d < LOGITS_TOLERANCE for d in ep4), ep4
    assert pp2[:2] == [None, None] and all(d is not None and d < LOGITS_TOLERANCE for d in pp2[2:]), pp2
    for per_layout in results:
        for r in per_layout.values():
            if r["max_abs_diff"] is not None:
                assert r["positions_shape"] == [2, 264]
                assert r["positions_vs_transformers"] < LOGITS_TOLERANCE, r


def _mixer_inputs(seed: int = 0):
    import torch

    g = torch.Generator().manual_seed(seed)
    b, l, h, p, groups, n = 2, SEQ, 4, 8, 2, 16
    x = torch.randn(b, l, h, p, generator=g, dtype=torch.float64)
    dt = torch.randn(b, l, h, generator=g, dtype=torch.float64) * 0.5
    A = -torch.rand(h, generator=g, dtype=torch.float64) * 4
    B = torch.randn(b, l, groups, n, generator=g, dtype=torch.float64)
    C = torch.randn(b, l, groups, n, generator=g, dtype=torch.float64)
    D = torch.rand(h, generator=g, dtype=torch.float64)
    dt_bias = torch.randn(h, generator=g, dtype=torch.float64) - 2
    return x, dt, A, B, C, D, dt_bias


def _sequential_scan(x, dt, A, B, C, D, dt_bias):
    """y_t = C_t . h_t + D x_t, h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T (dt = softplus(dt + bias))."""
    import torch
    import torch.nn.functional as F

    b, l, h, p = x.shape
    rep = h // B.shape[2]
    dt = F.softplus(dt + dt_bias)
    Bh, Ch = B.repeat_interleave(rep, dim=2), C.repeat_interleave(rep, dim=2)
    state = torch.zeros(b, h, p, B.shape[-1], dtype=x.dtype)
    ys = []
    for t in range(l):
        state = state * torch.exp(dt[:, t] * A)[..., None, None] + \
            dt[:, t, :, None, None] * x[:, t, :, :, None] * Bh[:, t, :, None, :]
        ys.append((state * Ch[:, t, :, None, :]).sum(-1) + D[:, None] * x[:, t])
    return torch.stack(ys, 1)


def cpu_scan_worker() -> dict:
    """In a rank process (the pytest process is never patched): the CPU shim's Mamba scan."""
    import torch

    from launcher.megatron import patches
    from launcher.megatron.cpu_compat import apply_cpu_compat

    patches.apply("mamba_ssm_stub")
    applied = apply_cpu_compat()
    import megatron.core.ssm.mamba_mixer as mixer

    x, dt, A, B, C, D, dt_bias = _mixer_inputs()
    expected = _sequential_scan(x, dt, A, B, C, D, dt_bias)
    out = {"applied": applied, "max_abs_diff": {}}
    for chunk in (4, 8, 32):    # 21 tokens: padded, several chunks, one chunk
        got = mixer.mamba_chunk_scan_combined(x, dt, A, B, C, chunk, D=D, dt_bias=dt_bias, dt_softplus=True)
        assert got.shape == expected.shape
        out["max_abs_diff"][chunk] = float((got - expected).abs().max())
    try:
        mixer.mamba_chunk_scan_combined(x, dt, A, B, C, 8, D=D, return_final_states=True)
    except NotImplementedError as e:
        out["refused"] = str(e)
    return out


@needs_mamba_ssm
def test_cpu_mamba_scan_equals_the_sequential_recurrence():
    [r] = run_on_ranks("test_nemotron_h_model:cpu_scan_worker", nprocs=1, timeout_s=300)
    assert "cpu_mamba_reference_kernels" in r["applied"], r
    # mamba_ssm's reference takes dt (and its cumsum) to float32: fp32 rounding, no more
    assert all(v < 1e-5 for v in r["max_abs_diff"].values()) and len(r["max_abs_diff"]) == 3, r
    assert "return_final_states" in r["refused"], r


def test_transformers_naive_mamba_is_wrong_across_chunks(random_nemotron_h):
    """Pins the transformers 5.14 defect the logits test works around (delete the workaround,
    the chunk_size=128 reference, when this fails)."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(random_nemotron_h, dtype=torch.float64).eval()
    mixer = model.model.layers[0].mixer
    x = torch.randn(2, SEQ, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        mixer.chunk_size = 128
        one_chunk = mixer.torch_forward(x)
        mixer.chunk_size = 8
        chunked = mixer.torch_forward(x)
    first = float((one_chunk[:, :8] - chunked[:, :8]).abs().max())
    later = float((one_chunk[:, 8:] - chunked[:, 8:]).abs().max())
    assert first < 1e-12, "the first chunk agrees"
    assert later > 1e-5, f"transformers' chunked Mamba path now agrees ({later}): the bug is fixed upstream"


def _hf(**over):
    hf = {"hybrid_override_pattern": "ME*-", "num_hidden_layers": 4, "hidden_size": 64, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 96, "mamba_num_heads": 8,
          "mamba_head_dim": 16, "n_groups": 2, "ssm_state_size": 16, "n_routed_experts": 8,
          "num_experts_per_tok": 2, "moe_intermediate_size": 32, "moe_shared_expert_intermediate_size": 48,
          "n_shared_experts": 2, "routed_scaling_factor": 2.5, "layer_norm_epsilon": 1e-5,
          "time_step_limit": [0.0, {"__float__": "Infinity"}]}
    hf.update(over)
    return hf


def test_nemotron_h_config_kwargs_and_refusals():
    from megatron.core.transformer.transformer_config import TransformerConfig

    from launcher.megatron.models import _nemotron_h_config_kwargs

    kw = _nemotron_h_config_kwargs(_hf())
    config = TransformerConfig(**kw, use_cpu_initialization=True)
    assert (config.num_layers, config.num_moe_experts, config.moe_router_topk) == (4, 8, 2)
    # transformers builds ONE shared MLP of that size, whatever n_shared_experts says
    assert config.moe_shared_expert_intermediate_size == 48
    assert config.moe_router_topk_scaling_factor == 2.5 and config.moe_router_enable_expert_bias
    assert config.use_mamba_mem_eff_path is False and config.mamba_num_groups == 2
    for over, key in (({"mlp_hidden_act": "silu"}, "mlp_hidden_act"), ({"attention_bias": True}, "attention_bias"),
                      ({"use_conv_bias": False}, "use_conv_bias"), ({"moe_latent_size": 32}, "moe_latent_size"),
                      ({"norm_topk_prob": False}, "norm_topk_prob"), ({"layer_norm_epsilon": 1e-6}, "layer_norm_epsilon"),
                      ({"time_step_limit": [0.0, 10.0]}, "time_step_limit"), ({"mamba_num_heads": 7}, "mamba_num_heads"),
                      ({"n_group": 4, "topk_group": 2, "num_experts_per_tok": 6}, "topk_group")):
        with pytest.raises(ValueError, match=f"config.json {key}="):
            _nemotron_h_config_kwargs(_hf(**over))


@needs_mamba_ssm
def test_megatron_imported_first_is_reported_not_silently_broken():
    """megatron.core.ssm imported before launcher.megatron records HAVE_MAMBA_SSM=False for good;
    the builder says so instead of failing inside Megatron."""
    code = ("import megatron.core.ssm.mamba_mixer as m; print(m.HAVE_MAMBA_SSM)\n"
            "from launcher.megatron.mamba_ssm_compat import megatron_mamba_status\n"
            "print(megatron_mamba_status())")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": REPO_ROOT}, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    assert lines[0] == "False"
    assert "imported before the mamba_ssm stub was installed" in lines[1] and lines[1].startswith("(False")


def test_check_buildable_accepts_nemotron_h_on_cpu(random_nemotron_h):
    from launcher.megatron.models import check_buildable

    assert check_buildable(random_nemotron_h, "cpu") == "NemotronHForCausalLM"
    with open(os.path.join(random_nemotron_h, "config.json")) as f:
        assert "layers_block_type" in json.load(f)     # transformers 5 format: read all the same
