"""Read a model card's dimensions from a Hugging Face config.json (pure JSON, no transformers)."""
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
    "hybrid_pattern": ("hybrid_override_pattern",),
    "vocab_size": ("vocab_size",),
}


def read_hf_config(path: str) -> dict[str, Any] | None:
    """config.json of a local checkpoint directory, or None when the path is not a local dir."""
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        return None
    with open(cfg_path) as f:
        return json.load(f)


def card_from_hf_config(hf: dict[str, Any]) -> dict[str, Any]:
    """Card fields derived from config.json: architecture and every dimension found."""
    out: dict[str, Any] = {}
    archs = hf.get("architectures") or []
    if archs:
        out["architecture"] = archs[0]
    for card_key, hf_keys in _CARD_KEYS.items():
        for k in hf_keys:
            if hf.get(k) is not None:
                out[card_key] = hf[k]
                break
    if "num_query_groups" not in out and "num_attention_heads" in out:
        out["num_query_groups"] = out["num_attention_heads"]
    out.setdefault("num_experts", 0)
    out.setdefault("moe_topk", 0)
    if not out["num_experts"]:
        out["moe_topk"] = 0
    return out
