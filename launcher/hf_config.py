"""A checkpoint's config.json: the one reader, and the facts read from it (pure JSON, no transformers).

``read_hf_config(path)`` returns the JSON object and raises ``ValueError`` when there is no
config.json; ``read_hf_config_if_present(path)`` returns None then (a hub id, say).  Both raise
``ValueError`` for a file that is not a JSON object.

Nemotron-H config.json comes in two formats, and both are read:

* the hub's (e.g. Nemotron-3-Nano-30B-A3B): ``hybrid_override_pattern`` ("MEMEM*E...",
  M Mamba, E MoE, * attention, - MLP) and ``num_hidden_layers``;
* transformers >= 5's ``save_pretrained``: ``layers_block_type`` (["mamba", "moe", ...], or
  the newer names "linear_attention" / "full_attention"), and no ``num_hidden_layers``.

``nemotron_h_unsupported`` states what this launcher's Megatron builder computes differently
from transformers (validation calls it before anything starts, the builder again).
"""
from __future__ import annotations

import json
import os
from typing import Any

# layers_block_type entries -> Megatron's hybrid pattern symbols
BLOCK_TYPE_SYMBOLS = {"mamba": "M", "linear_attention": "M", "moe": "E", "attention": "*",
                      "full_attention": "*", "mlp": "-"}
PATTERN_SYMBOLS = "ME*-"


def read_hf_config_if_present(path: str) -> dict[str, Any] | None:
    """config.json of a local checkpoint directory, or None when the path is not a local dir."""
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        return None
    with open(cfg_path, encoding="utf-8") as f:
        try:
            data = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{cfg_path} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{cfg_path} holds a JSON {type(data).__name__}; valid: a JSON object (a model config)")
    return data


def read_hf_config(path: str) -> dict[str, Any]:
    """config.json of a local checkpoint directory; ValueError when there is none."""
    data = read_hf_config_if_present(path)
    if data is None:
        raise ValueError(f"model.path={path!r} has no config.json (expected a local HF checkpoint)")
    return data


def tied_embeddings(config: dict[str, Any]) -> bool | None:
    """config.json's ``tie_word_embeddings`` (a multimodal config's ``text_config`` first, then the
    top level); None when neither says (transformers' per-architecture default applies)."""
    for level in (config.get("text_config") or {}, config):
        if isinstance(level, dict) and "tie_word_embeddings" in level:
            return bool(level["tie_word_embeddings"])
    return None


# config.json fields a card or a builder reads, and what each must be
_INT_FIELDS = {"num_hidden_layers": 1, "n_layer": 1, "num_layers": 1, "hidden_size": 1, "d_model": 1, "n_embd": 1,
               "num_attention_heads": 1, "n_head": 1, "num_key_value_heads": 1, "intermediate_size": 1,
               "vocab_size": 1, "max_position_embeddings": 1, "head_dim": 1, "num_experts": 0,
               "num_local_experts": 0, "n_routed_experts": 0, "num_experts_per_tok": 0, "moe_topk": 0, "top_k": 0,
               "moe_intermediate_size": 0}
_FLOAT_FIELDS = ("rms_norm_eps", "layer_norm_epsilon", "rope_theta", "initializer_range")
_BOOL_FIELDS = ("tie_word_embeddings", "attention_bias", "use_bias", "mlp_bias")
_STR_FIELDS = ("model_type", "hybrid_override_pattern", "torch_dtype", "dtype")


def config_json_problems(hf: dict[str, Any]) -> list[str]:
    """Fields of config.json whose JSON type (or range) is not what the card and the builder read:
    "config.json KEY=VALUE; valid: ..." lines (empty: every field read has the right type)."""
    out = []
    archs = hf.get("architectures")
    if archs is not None and (not isinstance(archs, list) or not archs or not all(isinstance(a, str) for a in archs)):
        out.append(f"config.json architectures={archs!r}; valid: a list of class names, e.g. [\"LlamaForCausalLM\"]")
    for key, low in _INT_FIELDS.items():
        v = hf.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < low):
            out.append(f"config.json {key}={v!r}; valid: an integer >= {low}")
    for key in _FLOAT_FIELDS:
        v = hf.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
            out.append(f"config.json {key}={v!r}; valid: a number")
    for key in _BOOL_FIELDS:
        if hf.get(key) is not None and not isinstance(hf[key], bool):
            out.append(f"config.json {key}={hf[key]!r}; valid: true or false")
    for key in _STR_FIELDS:
        if hf.get(key) is not None and not isinstance(hf[key], str):
            out.append(f"config.json {key}={hf[key]!r}; valid: a string")
    return out


def hybrid_layers(pattern: str) -> str:
    """The layer symbols of a hybrid pattern, without Megatron's '|' pipeline-stage separators."""
    return pattern.replace("|", "")


def nemotron_h_pattern(hf: dict[str, Any]) -> str:
    """Megatron's hybrid layer pattern from a Nemotron-H config.json, in either format."""
    pattern = hf.get("hybrid_override_pattern")
    blocks = hf.get("layers_block_type")
    if blocks is not None:
        if not isinstance(blocks, list):
            raise ValueError(f"config.json layers_block_type must be a list, got {type(blocks).__name__}")
        unknown = sorted({str(t) for t in blocks if t not in BLOCK_TYPE_SYMBOLS})
        if unknown:
            raise ValueError(f"config.json layers_block_type has unknown types {unknown}; "
                             f"known: {sorted(BLOCK_TYPE_SYMBOLS)}")
        from_blocks = "".join(BLOCK_TYPE_SYMBOLS[t] for t in blocks)
        if pattern and pattern != from_blocks:
            raise ValueError(f"config.json hybrid_override_pattern={pattern!r} disagrees with "
                             f"layers_block_type (pattern {from_blocks!r})")
        pattern = from_blocks
    if not pattern:
        raise ValueError("config.json of a NemotronHForCausalLM has neither hybrid_override_pattern "
                         "nor layers_block_type (one of them names every layer's type)")
    bad = sorted(set(pattern) - set(PATTERN_SYMBOLS))
    if bad:
        raise ValueError(f"config.json hybrid_override_pattern={pattern!r} has symbols {bad}; this launcher "
                         f"builds {list(PATTERN_SYMBOLS)} (M mamba, E MoE, * attention, - MLP)")
    if hf.get("num_hidden_layers") not in (None, len(pattern)):
        raise ValueError(f"config.json hybrid pattern {pattern!r} has {len(pattern)} layers but "
                         f"num_hidden_layers={hf['num_hidden_layers']}")
    return pattern


def _json_float(value: Any) -> float:
    """A float from config.json: a number, or transformers' {"__float__": "Infinity"} encoding."""
    if isinstance(value, dict) and "__float__" in value:
        return float(value["__float__"])
    return float(value)


def nemotron_h_unsupported(hf: dict[str, Any]) -> list[str]:
    """Every Nemotron-H config.json option this launcher's Megatron builder would compute
    differently from transformers' NemotronHForCausalLM, as "config.json KEY=VALUE is not
    supported ...; supported: ..." messages (empty: buildable).  Pure JSON: validation calls it
    before anything starts, the builder again before it builds."""
    out = []

    def refuse(key: str, supported: str) -> None:
        out.append(f"config.json {key}={hf.get(key)!r} is not supported by this launcher's Nemotron-H "
                   f"builder; supported: {supported}")

    if hf.get("mlp_hidden_act", "relu2") != "relu2":
        refuse("mlp_hidden_act", "'relu2'")
    if hf.get("mamba_hidden_act", "silu") != "silu":
        refuse("mamba_hidden_act", "'silu'")
    if hf.get("moe_latent_size"):
        refuse("moe_latent_size", "null (latent MoE, as in Nemotron-3-Super, is not built)")
    for key in ("use_bias", "attention_bias", "mlp_bias", "mamba_proj_bias"):
        if hf.get(key):
            refuse(key, "false")
    if not hf.get("use_conv_bias", True):
        refuse("use_conv_bias", "true (Megatron's Mamba mixer always has a conv bias)")
    if float(hf.get("layer_norm_epsilon", 1e-5)) != 1e-5:
        refuse("layer_norm_epsilon", "1e-05 (Megatron's Mamba mixer norm fixes it)")
    limit = hf.get("time_step_limit")
    if limit is not None and [_json_float(v) for v in limit] != [0.0, float("inf")]:
        refuse("time_step_limit", "[0.0, inf]")
    if hf.get("residual_in_fp32"):
        refuse("residual_in_fp32", "false")
    heads, groups = hf.get("mamba_num_heads"), hf.get("n_groups", 8)
    if heads is not None and groups and heads % groups:
        refuse("mamba_num_heads", f"a multiple of n_groups={groups}")
    topk = hf.get("num_experts_per_tok") or 1
    n_group = hf.get("n_group") or 1
    if topk > 1 and not hf.get("norm_topk_prob", True):
        refuse("norm_topk_prob", "true (Megatron normalizes sigmoid top-k scores)")
    if n_group > 1 and topk // (hf.get("topk_group") or 1) != 2:
        refuse("topk_group", "num_experts_per_tok // topk_group == 2 with n_group > 1 (transformers scores "
               "each expert group by its top-2 experts, Megatron by its top topk/topk_group)")
    return out
