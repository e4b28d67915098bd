"""References from the in-memory Megatron model for the exported HF tensors (GPT-style models).

For each linear of this rank's pipeline stage, the HF module name(s) ModelOpt's export writes it
to, and the weight the MMLU gate evaluated (``launcher.megatron.fold``: the exporter's own
quantize arithmetic, dequantized - ``launcher.megatron.exported_weights``), split the way the HF
checkpoint stores it:

    decoder.layers.i.self_attention.linear_qkv  -> model.layers.L.self_attn.{q,k,v}_proj
        (rows are per query group: [q heads of the group, k, v], each head_dim rows)
    decoder.layers.i.self_attention.linear_proj -> model.layers.L.self_attn.o_proj
    decoder.layers.i.mlp.linear_fc1 / linear_fc2      -> model.layers.L.mlp.{gate_proj,up_proj} / down_proj
    ...mlp.experts.local_experts.j.linear_fc1 / fc2   -> model.layers.L.mlp.experts.E.{gate,up}_proj / down_proj
    ...mlp.shared_experts.linear_fc1 / fc2            -> model.layers.L.mlp.shared_expert.{gate,up}_proj / down_proj
    output_layer                                      -> lm_head

Nemotron-H (Megatron's HybridModel) has one mixer per layer, under ``backbone.layers.L.mixer``:

    Mamba    mixer.in_proj / mixer.out_proj                 -> ...mixer.in_proj / out_proj
    attention self_attention.linear_qkv / linear_proj       -> ...mixer.{q,k,v}_proj / o_proj
    MoE      mlp.experts.local_experts.j.linear_fc1 / fc2   -> ...mixer.experts.E.up_proj / down_proj
             mlp.shared_experts.linear_fc1 / fc2            -> ...mixer.shared_experts.up_proj / down_proj
    MLP      mlp.linear_fc1 / linear_fc2                    -> ...mixer.up_proj / down_proj

L = layer.layer_number - 1 (global, whatever the PP stage); E = the expert's global index.
The mapping is this module's own reading of the HF layout, independent of ModelOpt's rule book.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass
class MappedLinear:
    hf_names: tuple            # HF module names the weight splits into, in split order
    kind: str                  # attention | expert | dense_mlp | shared_expert | mamba | output
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


def _attention_linears(attn, prefix: str) -> list[MappedLinear]:
    return [MappedLinear((f"{prefix}.q_proj", f"{prefix}.k_proj", f"{prefix}.v_proj"), "attention",
                         attn.linear_qkv, _qkv_splitter(attn.config)),
            MappedLinear((f"{prefix}.o_proj",), "attention", attn.linear_proj, _single)]


def _ffn_linears(mlp, prefix: str, shared_name: str) -> list[MappedLinear]:
    """A dense MLP, or a MoE layer's experts (and shared expert), under the HF ``prefix``."""
    experts = getattr(mlp, "experts", None)
    if experts is None:
        return _mlp_linears(mlp, prefix, "dense_mlp")
    local = getattr(experts, "local_experts", None)
    if local is None:
        raise ValueError(f"{prefix}: grouped-GEMM experts ({type(experts).__name__}) are not mapped; "
                         "build the model with moe_grouped_gemm=False")
    out = []
    indices = mlp.local_expert_indices
    for j, expert in enumerate(local):
        out.extend(_mlp_linears(expert, f"{prefix}.experts.{indices[j]}", "expert"))
    shared = getattr(mlp, "shared_experts", None)
    if shared is not None:
        out.extend(_mlp_linears(shared, f"{prefix}.{shared_name}", "shared_expert"))
    return out


def _hybrid_layer_linears(layer, base: str) -> list[MappedLinear]:
    mixer = f"{base}.mixer"
    if type(layer).__name__ == "MambaLayer":
        return [MappedLinear((f"{mixer}.in_proj",), "mamba", layer.mixer.in_proj, _single),
                MappedLinear((f"{mixer}.out_proj",), "mamba", layer.mixer.out_proj, _single)]
    attn = getattr(layer, "self_attention", None)
    if attn is not None and type(attn).__name__ != "IdentityOp":
        return _attention_linears(attn, mixer)
    mlp = getattr(layer, "mlp", None)
    if mlp is not None and type(mlp).__name__ != "IdentityOp":
        return _ffn_linears(mlp, mixer, "shared_experts")
    raise ValueError(f"{base}: layer {type(layer).__name__} has no mixer that is mapped to HF names")


def linear_modules(model) -> list[MappedLinear]:
    """Every mapped linear of this rank's stage of ``model`` (a GPTModel or HybridModel, or a
    wrapper of one)."""
    from launcher.megatron.models import unwrap_model

    inner = unwrap_model(model)
    kind = type(inner).__name__
    if not hasattr(inner, "decoder") or kind not in ("GPTModel", "HybridModel"):
        raise ValueError(f"{kind}: only GPTModel and HybridModel layouts are mapped to HF names")
    out: list[MappedLinear] = []
    for layer in inner.decoder.layers:
        if kind == "HybridModel":
            out.extend(_hybrid_layer_linears(layer, f"backbone.layers.{layer.layer_number - 1}"))
            continue
        base = f"model.layers.{layer.layer_number - 1}"
        out.extend(_attention_linears(layer.self_attention, f"{base}.self_attn"))
        out.extend(_ffn_linears(layer.mlp, f"{base}.mlp", "shared_expert"))
    output = getattr(inner, "output_layer", None)
    if output is not None and getattr(inner, "post_process", False) and not inner.share_embeddings_and_output_weights:
        out.append(MappedLinear(("lm_head",), "output", output, _single))
    return out


def quantized_hf_modules(model) -> set[str]:
    """HF module names whose Megatron linear has an enabled weight quantizer (this rank)."""
    return {n for m in linear_modules(model) if m.weight_quantized for n in m.hf_names}


# hybrid pattern symbol -> the linear kinds its layers hold
PATTERN_KINDS = {"M": ("mamba",), "*": ("attention",), "E": ("expert", "shared_expert"), "-": ("dense_mlp",)}
SAMPLED_KINDS = ("attention", "expert", "dense_mlp", "shared_expert", "mamba")


def layers_by_kind(num_layers: int, hybrid_pattern: str | None = None) -> dict[str, list[int]]:
    """Global layer indices holding each linear kind: every layer for GPT models (attention and
    an MLP or MoE in each), the pattern's layers for hybrid models."""
    if not hybrid_pattern:
        return {kind: list(range(num_layers)) for kind in SAMPLED_KINDS}
    symbols = hybrid_pattern.replace("|", "")
    return {kind: [i for i, c in enumerate(symbols) if kind in PATTERN_KINDS.get(c, ())]
            for kind in SAMPLED_KINDS}


def select_samples(linears: list[MappedLinear], per_kind: int, num_layers: int,
                   num_experts: int = 0, hybrid_pattern: str | None = None) -> list[MappedLinear]:
    """``per_kind`` linears of each kind, spread over the layers, chosen identically on every rank.

    The choice depends only on global names (layer number, expert index) and the model card
    (its hybrid pattern says which layers hold which kind), so ranks holding different PP
    stages pick disjoint parts of one global sample without communicating.
    """
    import re

    chosen = []
    for kind, kind_layers in layers_by_kind(num_layers, hybrid_pattern).items():
        if not kind_layers:
            continue
        n = len(kind_layers)
        wanted = sorted({(kind_layers[((p * n) // max(per_kind, 1) + (n // max(per_kind, 1)) // 2) % n], p)
                         for p in range(per_kind)})
        of_kind = [m for m in linears if m.kind == kind]
        for layer, p in wanted:
            in_layer = [m for m in of_kind if re.search(rf"(?:^|\.)layers\.{layer}\.", m.hf_names[0])]
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
    """HF module name -> (kind, tensor): the weight the MMLU gate evaluated for each linear,
    split to HF layout.  For a quantized linear that is the exporter's arithmetic dequantized
    (``launcher.megatron.exported_weights``, what the gate folds), else
    ``weight_quantizer(weight)``; unquantized linears: the weight."""
    import torch

    from launcher.megatron.exported_weights import gated_weight

    out = {}
    with torch.no_grad():
        for m in linears:
            w = m.module.weight
            if m.weight_quantized:
                w = gated_weight(m.module)
            for name, part in zip(m.hf_names, m.split(w.detach())):
                out[name] = (m.kind, part.cpu().clone())
    return out
