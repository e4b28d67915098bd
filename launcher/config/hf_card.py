"""Read a model card's dimensions from a Hugging Face config.json (pure JSON, no transformers).

Nemotron-H config.json comes in two formats, and both are read:

* the hub's (e.g. Nemotron-3-Nano-30B-A3B): ``hybrid_override_pattern`` ("MEMEM*E...",
  M Mamba, E MoE, * attention, - MLP) and ``num_hidden_layers``;
* transformers >= 5's ``save_pretrained``: ``layers_block_type`` (["mamba", "moe", ...], or
  the newer names "linear_attention" / "full_attention"), and no ``num_hidden_layers``.

A config.json the reader cannot use raises ``ValueError`` naming the missing or bad key.
"""
from __future__ import annotations

import json
import os
from typing import Any

# card key -> config.json keys tried in order (architectures name these differently)
_CARD_KEYS: dict[str, tuple[str, ...]] = {
    "num_layers": ("num_hidden_layers", "n_layer", "num_layers"),
    "hidden_size": ("hidden_size", "d_model", "n_embd"),
    "num_attention_heads": ("num_attention_heads", "n_head"),
    "num_query_groups": ("num_key_value_heads",),
    "num_experts": ("num_experts", "num_local_experts", "n_routed_experts"),
    "moe_topk": ("num_experts_per_tok", "moe_topk", "top_k"),
    "vocab_size": ("vocab_size",),
}
REQUIRED = ("num_layers", "hidden_size", "num_attention_heads")
HYBRID_ARCHITECTURES = ("NemotronHForCausalLM",)

# layers_block_type entries -> Megatron's hybrid pattern symbols
BLOCK_TYPE_SYMBOLS = {"mamba": "M", "linear_attention": "M", "moe": "E", "attention": "*",
                      "full_attention": "*", "mlp": "-"}
PATTERN_SYMBOLS = "ME*-"


def read_hf_config(path: str) -> dict[str, Any] | None:
    """config.json of a local checkpoint directory, or None when the path is not a local dir."""
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        return None
    with open(cfg_path) as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{cfg_path} is not valid JSON: {e}") from e


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


def card_from_hf_config(hf: dict[str, Any]) -> dict[str, Any]:
    """Card fields derived from config.json: architecture and every dimension found.

    Raises ValueError naming the key when config.json lacks what a card needs.
    """
    out: dict[str, Any] = {}
    archs = hf.get("architectures") or []
    if not archs:
        raise ValueError("config.json has no 'architectures' entry (e.g. [\"LlamaForCausalLM\"])")
    out["architecture"] = archs[0]
    for card_key, hf_keys in _CARD_KEYS.items():
        for k in hf_keys:
            if hf.get(k) is not None:
                out[card_key] = hf[k]
                break
    if out["architecture"] in HYBRID_ARCHITECTURES:
        pattern = nemotron_h_pattern(hf)
        out["hybrid_pattern"] = pattern
        out["num_layers"] = len(pattern)
        if "E" not in pattern:
            out["num_experts"] = 0
    missing = [k for k in REQUIRED if k not in out]
    if missing:
        raise ValueError("config.json lacks " + ", ".join(
            f"{k} (one of {list(_CARD_KEYS[k])})" for k in missing))
    if "num_query_groups" not in out:
        out["num_query_groups"] = out["num_attention_heads"]
    out.setdefault("num_experts", 0)
    out.setdefault("moe_topk", 0)
    if not out["num_experts"]:
        out["moe_topk"] = 0
    return out
