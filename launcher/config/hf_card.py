"""A model card's fields derived from a Hugging Face config.json (``launcher.hf_config`` reads it).

A config.json the card cannot use raises ``ValueError`` naming the missing or bad key.
"""
from __future__ import annotations

from typing import Any

from launcher.architectures import is_hybrid
from launcher.hf_config import config_json_problems, nemotron_h_pattern

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


def card_from_hf_config(hf: dict[str, Any]) -> dict[str, Any]:
    """Card fields derived from config.json: architecture and every dimension found.

    Raises ValueError naming the key when config.json lacks what a card needs.
    """
    problems = config_json_problems(hf)
    if problems:
        raise ValueError("; ".join(problems))
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
    if is_hybrid(out["architecture"]):
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
