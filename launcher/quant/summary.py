"""What ``mtq.quantize`` actually did: quantizers per format and module kind, and the checks.

Every rank describes its own quantizers with global names (pipeline layer offset and expert-
parallel expert index applied); rank lists are gathered and merged, so the summary covers the
whole model whatever the layout.  Checks (``check_summary``):

* the recipe quantizes, but no quantizer is enabled -> fail;
* ``quantize_experts`` and some expert linear has no enabled weight quantizer -> fail (the
  model would silently stay BF16 in its experts, as in the reference's #1255 / #569).
"""
from __future__ import annotations

import re
from collections import Counter
from typing import Any

KINDS = ("attention", "dense_mlp", "experts", "shared_experts", "router", "mamba", "output_layer",
         "embedding", "other")


def module_kind(name: str) -> str:
    if ".experts." in name or name.startswith("experts."):
        return "experts"
    if "shared_expert" in name:
        return "shared_experts"
    if "router" in name or name.endswith("mlp.gate"):
        return "router"
    if "self_attention" in name or "self_attn" in name:
        return "attention"
    if ".mixer." in name:
        return "mamba"
    if ".mlp." in name:
        return "dense_mlp"
    if name.startswith("output_layer"):
        return "output_layer"
    if "embedding" in name:
        return "embedding"
    return "other"


def quantizer_format(quantizer) -> str:
    """nvfp4 | mxfp4 | fp8 | int4 | int8 | ... from a TensorQuantizer's num_bits / block_sizes."""
    num_bits = getattr(quantizer, "num_bits", None)
    blocks = getattr(quantizer, "block_sizes", None) or {}
    scale_bits = tuple(blocks.get("scale_bits") or ()) if isinstance(blocks, dict) else ()
    if isinstance(num_bits, (tuple, list)):
        num_bits = tuple(num_bits)
        if num_bits == (2, 1):
            return "nvfp4" if scale_bits == (4, 3) else "mxfp4" if scale_bits == (8, 0) else "fp4"
        if num_bits == (4, 3):
            return "mxfp8" if scale_bits == (8, 0) else "fp8"
        if num_bits == (3, 2):
            return "fp6"
        return f"fp{sum(num_bits) + 1}"
    if isinstance(num_bits, int):
        return f"int{num_bits}"
    return "unknown"


_LAYER = re.compile(r"^(.*?layers\.)(\d+)(?=\.|$)")
_INDEX = re.compile(r"\.\d+(?=\.|$)")
_EXPERT = re.compile(r"^(.*?\.experts\.local_experts\.)(\d+)(?=\.|$)")


def _global_index_maps(model) -> tuple[dict[str, int], dict[str, int]]:
    """Local module names -> global index: layers (PP offset) and local experts (EP offset)."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    layers: dict[str, int] = {}
    experts: dict[str, int] = {}
    for name, module in model.named_modules():
        if hasattr(module, "layer_number") and _LAYER.fullmatch(name):
            layers[name] = module.layer_number - 1
        if isinstance(module, MoELayer):
            for local, global_index in enumerate(module.local_expert_indices):
                experts[f"{name}.experts.local_experts.{local}"] = global_index
    return layers, experts


def _globalize(name: str, maps: tuple[dict[str, int], dict[str, int]]) -> str:
    layers, experts = maps
    match = _EXPERT.match(name)
    if match and match.group(0) in experts:
        name = f"{match.group(1)}{experts[match.group(0)]}{name[match.end():]}"
    match = _LAYER.match(name)
    if match and match.group(0) in layers:
        name = f"{match.group(1)}{layers[match.group(0)]}{name[match.end():]}"
    return name


def describe_quantizers(model) -> list[dict[str, Any]]:
    """This rank's quantizers: global name, module kind, role (weight/input/output), format, enabled."""
    from modelopt.torch.quantization.nn import TensorQuantizer

    from launcher.megatron.models import unwrap_model

    inner = unwrap_model(model)
    maps = _global_index_maps(inner)
    rows = []
    for name, module in inner.named_modules():
        if not isinstance(module, TensorQuantizer):
            continue
        owner, _, role = name.rpartition(".")
        rows.append({
            "name": _globalize(name, maps),
            "module": _globalize(owner, maps),
            "kind": module_kind(owner),
            "role": role.replace("_quantizer", ""),
            "format": quantizer_format(module),
            "enabled": bool(module.is_enabled),
        })
    return rows


def weight_modules(model) -> dict[str, str]:
    """Global name -> kind of this rank's modules that own a 2-D ``weight`` (linears, router,
    embedding, output layer), quantized or not: the denominator of the summary."""
    import torch

    from launcher.megatron.models import unwrap_model

    inner = unwrap_model(model)
    maps = _global_index_maps(inner)
    out = {}
    for name, module in inner.named_modules():
        weight = module._parameters.get("weight") if hasattr(module, "_parameters") else None
        if isinstance(weight, torch.nn.Parameter) and weight.dim() == 2:
            out[_globalize(name, maps)] = module_kind(name)
    return out


def gather_summary(model) -> dict[str, Any]:
    """Merge every rank's quantizers (collective: all ranks call); same result on every rank."""
    from launcher.megatron.collectives import all_gather

    local = {"quantizers": describe_quantizers(model), "weight_modules": weight_modules(model)}
    gathered = all_gather(local)
    quantizers: dict[str, dict] = {}
    modules: dict[str, str] = {}
    for part in gathered:
        for row in part["quantizers"]:
            quantizers.setdefault(row["name"], row)   # TP/DP replicas describe the same quantizer
        modules.update(part["weight_modules"])
    return summarize(list(quantizers.values()), modules)


def summarize(quantizers: list[dict[str, Any]], modules: dict[str, str]) -> dict[str, Any]:
    """Counts per format and per module kind; ``modules`` maps weight-module names to kinds."""
    enabled = [q for q in quantizers if q["enabled"]]
    weight_quantized = {q["module"] for q in enabled if q["role"] == "weight"}
    by_format = Counter(q["format"] for q in enabled)
    by_kind: dict[str, dict[str, int]] = {}
    for name, kind in modules.items():
        entry = by_kind.setdefault(kind, {"modules": 0, "weight_quantized": 0, "quantizers": 0, "enabled": 0})
        entry["modules"] += 1
        entry["weight_quantized"] += int(name in weight_quantized)
    for q in quantizers:
        entry = by_kind.setdefault(q["kind"], {"modules": 0, "weight_quantized": 0, "quantizers": 0, "enabled": 0})
        entry["quantizers"] += 1
        entry["enabled"] += int(q["enabled"])
        if q["enabled"]:
            key = f"{q['role']}:{q['format']}"
            entry[key] = entry.get(key, 0) + 1
    named: dict[str, dict[str, list[int]]] = {}
    for name, kind in sorted(modules.items()):
        counts = named.setdefault(kind, {}).setdefault(_INDEX.sub(".*", name), [0, 0])
        counts[0] += int(name in weight_quantized)
        counts[1] += 1
    experts = sorted(n for n, k in modules.items() if k == "experts")
    unquantized_experts = [m for m in experts if m not in weight_quantized]
    return {
        "quantizers_total": len(quantizers),
        "quantizers_enabled": len(enabled),
        "enabled_by_format": dict(sorted(by_format.items())),
        "by_module_kind": dict(sorted(by_kind.items())),
        # per kind, each linear by name with its layer/expert indices as "*": [weight-quantized, total]
        "weight_quantized_by_name": named,
        "expert_linears": len(experts),
        "expert_linears_weight_quantized": len(experts) - len(unquantized_experts),
        "unquantized_expert_linears": unquantized_experts,
    }


def check_summary(summary: dict[str, Any], should_quantize: bool, quantize_experts: bool) -> list[str]:
    """Problems that must fail the stage (empty list: all good)."""
    problems = []
    if should_quantize and summary["quantizers_enabled"] == 0:
        problems.append("the recipe should quantize, but mtq.quantize left no quantizer enabled")
    if should_quantize and quantize_experts and summary["unquantized_expert_linears"]:
        missing = summary["unquantized_expert_linears"]
        problems.append(f"{len(missing)} of {summary['expert_linears']} expert linears have no enabled weight "
                        f"quantizer (they would silently stay unquantized), e.g. {missing[:4]}; "
                        "check the recipe's exclude_modules or set recipe.quantize_experts=false")
    return problems
