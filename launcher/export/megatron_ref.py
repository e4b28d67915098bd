"""References from the in-memory Megatron model for the exported HF tensors (GPT-style models).

For each linear of this rank's pipeline stage, the HF module name(s) ModelOpt's export writes it
to, and the weight the quantized model actually computes with: ``weight_quantizer(weight)``
(ModelOpt's fake quantization), split the way the HF checkpoint stores it:

    decoder.layers.i.self_attention.linear_qkv  -> model.layers.L.self_attn.{q,k,v}_proj
        (rows are per query group: [q heads of the group, k, v], each head_dim rows)
    decoder.layers.i.self_attention.linear_proj -> model.layers.L.self_attn.o_proj
    decoder.layers.i.mlp.linear_fc1 / linear_fc2      -> model.layers.L.mlp.{gate_proj,up_proj} / down_proj
    ...mlp.experts.local_experts.j.linear_fc1 / fc2   -> model.layers.L.mlp.experts.E.{gate,up}_proj / down_proj
    ...mlp.shared_experts.linear_fc1 / fc2            -> model.layers.L.mlp.shared_expert.{gate,up}_proj / down_proj
    output_layer                                      -> lm_head

L = layer.layer_number - 1 (global, whatever the PP stage); E = the expert's global index.
The mapping is this module's own reading of the HF layout, independent of ModelOpt's rule book.
Hybrid (Nemotron-H) models are not mapped: ``linear_modules`` raises ValueError for them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass
class MappedLinear:
    hf_names: tuple            # HF module names the weight splits into, in split order
    kind: str                  # attention | expert | dense_mlp | shared_expert | output
    module: object             # the Megatron linear
    split: Callable            # fused weight [out, in] -> tuple of tensors (one per hf name)

    @property
    def weight_quantized(self) -> bool:
        q = getattr(self.module, "weight_quantizer", None)
        return bool(q is not None and getattr(q, "is_enabled", False))


def _single(w):
    return (w,)


def _gated(w):
    half = w.shape[0] // 2
    return w[:half], w[half:]


def _qkv_splitter(config):
    groups = config.num_query_groups
    per_group = config.num_attention_heads // groups
    head_dim = config.kv_channels

    def split(w):
        hidden = w.shape[-1]
        v = w.reshape(groups, per_group + 2, head_dim, hidden)
        return (v[:, :per_group].reshape(-1, hidden), v[:, per_group].reshape(-1, hidden),
                v[:, per_group + 1].reshape(-1, hidden))

    if getattr(config, "attention_output_gate", False):
        raise ValueError("gated attention (attention_output_gate) is not mapped by launcher.export.megatron_ref")
    return split


def _mlp_linears(mlp, prefix: str, kind: str) -> list[MappedLinear]:
    out = []
    fc1, fc2 = getattr(mlp, "linear_fc1", None), getattr(mlp, "linear_fc2", None)
    if fc1 is not None:
        gated = mlp.config.gated_linear_unit
        names = (f"{prefix}.gate_proj", f"{prefix}.up_proj") if gated else (f"{prefix}.up_proj",)
        out.append(MappedLinear(names, kind, fc1, _gated if gated else _single))
    if fc2 is not None:
        out.append(MappedLinear((f"{prefix}.down_proj",), kind, fc2, _single))
    return out


def linear_modules(model) -> list[MappedLinear]:
    """Every mapped linear of this rank's stage of ``model`` (a GPTModel or a wrapper of one)."""
    from launcher.megatron.models import unwrap_model

    inner = unwrap_model(model)
    if not hasattr(inner, "decoder") or type(inner).__name__ != "GPTModel":
        raise ValueError(f"{type(inner).__name__}: only GPTModel layouts are mapped to HF names")
    out: list[MappedLinear] = []
    for layer in inner.decoder.layers:
        base = f"model.layers.{layer.layer_number - 1}"
        attn = layer.self_attention
        out.append(MappedLinear((f"{base}.self_attn.q_proj", f"{base}.self_attn.k_proj", f"{base}.self_attn.v_proj"),
                                "attention", attn.linear_qkv, _qkv_splitter(attn.config)))
        out.append(MappedLinear((f"{base}.self_attn.o_proj",), "attention", attn.linear_proj, _single))
        mlp = layer.mlp
        experts = getattr(mlp, "experts", None)
        if experts is None:
            out.extend(_mlp_linears(mlp, f"{base}.mlp", "dense_mlp"))
            continue
        local = getattr(experts, "local_experts", None)
        if local is None:
            raise ValueError(f"{base}: grouped-GEMM experts ({type(experts).__name__}) are not mapped; "
                             "build the model with moe_grouped_gemm=False")
        indices = mlp.local_expert_indices
        for j, expert in enumerate(local):
            out.extend(_mlp_linears(expert, f"{base}.mlp.experts.{indices[j]}", "expert"))
        shared = getattr(mlp, "shared_experts", None)
        if shared is not None:
            out.extend(_mlp_linears(shared, f"{base}.mlp.shared_expert", "shared_expert"))
    output = getattr(inner, "output_layer", None)
    if output is not None and getattr(inner, "post_process", False) and not inner.share_embeddings_and_output_weights:
        out.append(MappedLinear(("lm_head",), "output", output, _single))
    return out


def quantized_hf_modules(model) -> set[str]:
    """HF module names whose Megatron linear has an enabled weight quantizer (this rank)."""
    return {n for m in linear_modules(model) if m.weight_quantized for n in m.hf_names}


def select_samples(linears: list[MappedLinear], per_kind: int, num_layers: int,
                   num_experts: int = 0) -> list[MappedLinear]:
    """``per_kind`` linears of each kind, spread over the layers, chosen identically on every rank.

    The choice depends only on global names (layer number, expert index), so ranks holding
    different PP stages pick disjoint parts of one global sample without communicating.
    """
    import re

    wanted = set()
    for p in range(per_kind):
        layer = (p * num_layers) // max(per_kind, 1) + (num_layers // max(per_kind, 1)) // 2
        wanted.add((layer % num_layers, p))
    chosen = []
    for kind in ("attention", "expert", "dense_mlp", "shared_expert"):
        of_kind = [m for m in linears if m.kind == kind]
        for layer, p in sorted(wanted):
            in_layer = [m for m in of_kind if re.match(rf"model\.layers\.{layer}\.", m.hf_names[0])]
            if not in_layer:
                continue
            if kind == "expert":
                e = (3 * p + layer) % max(num_experts, 1)
                in_layer = [m for m in in_layer if f".experts.{e}." in m.hf_names[0]]
                if not in_layer:
                    continue  # that expert lives on another EP rank
            chosen.append(in_layer[p % len(in_layer)])
    return chosen


def fake_quantized_references(linears: list[MappedLinear]) -> dict:
    """HF module name -> (kind, tensor): the weight each linear computes with, split to HF layout."""
    import torch

    out = {}
    with torch.no_grad():
        for m in linears:
            w = m.module.weight
            if m.weight_quantized:
                w = m.module.weight_quantizer(w)
            for name, part in zip(m.hf_names, m.split(w.detach())):
                out[name] = (m.kind, part.cpu().clone())
    return out
