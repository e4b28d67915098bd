"""Megatron-Core model built from an HF config.json equals transformers, at EP4 and PP2xEP2 (gloo).

One 4-rank run covers both layouts (parallel_state is re-initialized between them) and checks
that this rank's Megatron groups equal launcher.topology's.  Plus single-process checks of the
builder's user errors.
"""
from __future__ import annotations

import json
import os

import pytest

from launcher_testing.checkpoints import hf_logits
from launcher_testing.ranks import run_on_ranks

LOGITS_TOLERANCE = 1e-4   # fp32, max |megatron - transformers|

pytestmark = pytest.mark.torch   # imports torch, Megatron or ModelOpt (in-process or in its ranks)


def logits_worker(hf_path: str, layouts: list[dict]) -> dict:
    """Per layout: max |diff| vs transformers on the last PP stage, and whether groups matched."""
    import torch

    from launcher.megatron.dist import init_distributed, megatron_group_ranks, shutdown
    from launcher.megatron.forward import forward_logits
    from launcher.megatron.hf_io import import_hf_weights
    from launcher.megatron.models import build_model
    from launcher.topology import ParallelDims

    rank = int(os.environ["RANK"])
    tokens = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(3))
    reference = hf_logits(hf_path, tokens)
    out = {}
    for layout in layouts:
        dims = ParallelDims(world_size=int(os.environ["WORLD_SIZE"]), **layout)
        init_distributed(dims, "cpu", timeout_s=90, seed=1234)
        groups = megatron_group_ranks()
        mismatched = [k for k, ranks in groups.items() if ranks != dims.group_of(k, rank)]
        model = build_model(hf_path, dims, "cpu", "bfloat16", "alltoall")
        import_hf_weights(model, hf_path, "float32")
        logits = forward_logits(model, tokens)
        positions = torch.tensor([11, 4])   # LM head at one position per row only (the MMLU gate's call)
        at = forward_logits(model, tokens, positions=positions)
        rows = torch.arange(2)
        key = "_".join(f"{k}{v}" for k, v in layout.items())
        out[key] = {
            "max_abs_diff": None if logits is None else float((logits - reference).abs().max()),
            "positions_shape": None if at is None else list(at.shape),
            "positions_vs_full": None if at is None else float((at - logits[rows, positions]).abs().max()),
            "positions_vs_transformers": None if at is None else float((at - reference[rows, positions]).abs().max()),
            "shape": None if logits is None else list(logits.shape),
            "param_dtype": str(next(model.parameters()).dtype),
            "group_mismatch": mismatched,
        }
    shutdown()
    return out


@pytest.mark.slow
def test_megatron_logits_match_transformers_ep4_and_pp2_ep2(random_tiny_moe):
    results = run_on_ranks("test_megatron_model:logits_worker", nprocs=4, timeout_s=300,
                           kwargs={"hf_path": random_tiny_moe, "layouts": [{"ep": 4}, {"pp": 2, "ep": 2}]})
    for rank, per_layout in enumerate(results):
        for layout, r in per_layout.items():
            assert r["group_mismatch"] == [], (rank, layout, r)
            assert r["param_dtype"] == "torch.float32", "CPU runs fp32 whatever dtype is asked"
    # EP4: every rank is a last stage; PP2xEP2: ranks 2,3 (pp rank 1) hold the logits
    ep4 = [r["ep4"]["max_abs_diff"] for r in results]
    pp2 = [r["pp2_ep2"]["max_abs_diff"] for r in results]
    assert all(d is not None and d < LOGITS_TOLERANCE for d in ep4), ep4
    assert pp2[:2] == [None, None] and all(d is not None and d < LOGITS_TOLERANCE for d in pp2[2:]), pp2
    assert results[0]["ep4"]["shape"] == [2, 12, 264]
    # forward_logits(positions=...): the LM head on one hidden state per row gives those rows'
    # logits of the full forward (same GEMM inner dimension; fp32 summation order may differ)
    for rank, per_layout in enumerate(results):
        for layout, r in per_layout.items():
            if r["max_abs_diff"] is None:
                assert r["positions_shape"] is None, (rank, layout, r)
                continue
            assert r["positions_shape"] == [2, 264], (rank, layout, r)
            assert r["positions_vs_full"] < 1e-5 and r["positions_vs_transformers"] < LOGITS_TOLERANCE, (rank, layout, r)


def test_unknown_architecture_lists_supported(tmp_path):
    from launcher.architectures import SUPPORTED as SUPPORTED_ARCHITECTURES
    from launcher.megatron.models import check_buildable

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["MixtralForCausalLM"]}))
    with pytest.raises(ValueError) as e:
        check_buildable(str(tmp_path), "cpu")
    assert "MixtralForCausalLM" in str(e.value)
    assert all(a in str(e.value) for a in SUPPORTED_ARCHITECTURES)


def test_gpt_config_reads_everything_from_config_json():
    from launcher.megatron.models import _gpt_config_kwargs, _rope

    hf = {"num_hidden_layers": 3, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 32, "intermediate_size": 96, "rms_norm_eps": 1e-5, "num_experts": 8,
          "num_experts_per_tok": 2, "moe_intermediate_size": 48, "norm_topk_prob": False,
          "mlp_only_layers": [1], "rope_parameters": {"rope_theta": 5e5, "rope_type": "default"}}
    kw = _gpt_config_kwargs("Qwen3MoeForCausalLM", hf)
    assert (kw["kv_channels"], kw["num_query_groups"], kw["ffn_hidden_size"]) == (32, 2, 96)
    assert kw["layernorm_epsilon"] == 1e-5 and kw["qk_layernorm"] is True
    assert kw["moe_router_pre_softmax"] is True and kw["moe_layer_freq"] == [1, 0, 1]
    assert _rope(hf)["rotary_base"] == 5e5
    with pytest.raises(ValueError, match="rope_type"):
        _rope({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    assert _gpt_config_kwargs("LlamaForCausalLM", hf)["qk_layernorm"] is False


def test_nemotron_h_config_from_config_json():
    """The Nemotron-3-Nano shape maps to a valid TransformerConfig (the model itself:
    tests/test_nemotron_h_model.py)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    from launcher.hf_config import nemotron_h_pattern
    from launcher.megatron.models import _nemotron_h_config_kwargs

    pattern = "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"
    hf = {"num_hidden_layers": 52, "hybrid_override_pattern": pattern, "hidden_size": 2688,
          "num_attention_heads": 32, "num_key_value_heads": 2, "head_dim": 128, "intermediate_size": 1856,
          "mamba_num_heads": 64, "mamba_head_dim": 64, "ssm_state_size": 128, "n_groups": 8,
          "n_routed_experts": 128, "num_experts_per_tok": 6, "moe_intermediate_size": 1856,
          "moe_shared_expert_intermediate_size": 3712, "n_shared_experts": 1, "routed_scaling_factor": 2.5,
          "n_group": 1, "topk_group": 1, "layer_norm_epsilon": 1e-5, "mlp_hidden_act": "relu2"}
    kw = _nemotron_h_config_kwargs(hf)
    config = TransformerConfig(**kw, use_cpu_initialization=True)
    assert config.num_layers == 52 and config.num_moe_experts == 128 and config.moe_router_topk == 6
    assert config.moe_router_score_function == "sigmoid" and config.num_query_groups == 2
    blocks = {"M": "mamba", "E": "moe", "*": "attention"}
    assert nemotron_h_pattern({"layers_block_type": [blocks[c] for c in pattern]}) == pattern
    with pytest.raises(ValueError, match="num_hidden_layers"):
        nemotron_h_pattern({"hybrid_override_pattern": "ME*", "num_hidden_layers": 4})
