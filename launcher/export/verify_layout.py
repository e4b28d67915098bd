"""Structural checks of an exported HF checkpoint: files, index, quantization config, tensors.

Everything here reads JSON and safetensors headers only (``safetensors_dir``), so it is cheap
for any checkpoint size.  Each check appends precise messages (naming the tensor, module or
file) to a ``Findings``; ``verify.verify_export`` turns them into verify.json.
"""
from __future__ import annotations

import fnmatch
import json
import os
import re
from dataclasses import dataclass, field
from typing import Optional

from launcher import formats
from launcher.hf_config import tied_embeddings
from launcher.export.safetensors_dir import (
    DTYPE_BYTES, INDEX_NAME, SINGLE_NAME, TensorInfo, read_all_headers, read_index, safetensors_files)

# recipe format -> what hf_quant_config.json's "quantization" must say (None: not quantized),
# from the one format table (launcher/formats.py): every format the pipeline carries.
# (quant_algo values accepted; "W4A16_NVFP4" is NVFP4 weight-only: no input_scale; group sizes
# accepted per quant_algo: NVFP4 blocks are 16, ModelOpt's weight-only NVFP4 recipes write 16 or
# 32 - general/ptq/nvfp4_mlp_weight_only uses 32; every weight_scale is then checked against it)
FORMATS = {
    name: None if not f.quant_algos else
    {"quant_algo": f.quant_algos, **({"group_size": dict(f.group_sizes)} if f.group_sizes else {})}
    for name, f in ((n, formats.FORMATS[n]) for n in formats.CARRIED)
}
WEIGHT_ONLY_ALGOS = ("W4A16_NVFP4",)
SCALE_LEAVES = ("weight_scale", "weight_scale_2", "input_scale")
KV_SCALE_LEAVES = ("k_scale", "v_scale")
HIGH_PRECISION = ("bfloat16", "float16", "float32")
QUANTIZED_WEIGHT_DTYPES = ("uint8", "float8_e4m3fn")
SIDECAR = re.compile(r"^model-\d{5}-of-\d{5}\.json$")
LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")
EXPERT_RE = re.compile(r"^(.*?\.experts)\.(\d+)\.(.+)$")
EMBEDDING_HINTS = ("embed_tokens", "embeddings", "wte", "word_embeddings")
MAX_LISTED = 20


@dataclass
class Findings:
    errors: list[str] = field(default_factory=list)
    checks: dict = field(default_factory=dict)

    def error(self, msg: str) -> None:
        self.errors.append(msg)

    def errors_named(self, what: str, names: list[str]) -> None:
        """One message per name (up to MAX_LISTED), then a count of the rest."""
        for n in names[:MAX_LISTED]:
            self.error(what.format(n))
        if len(names) > MAX_LISTED:
            self.error(f"... and {len(names) - MAX_LISTED} more like: " + what.format(names[MAX_LISTED]))


def check_format_name(fmt: str) -> dict | None:
    if fmt not in FORMATS:
        raise ValueError(f"recipe format {fmt!r} cannot be verified; supported: {sorted(FORMATS)}")
    return FORMATS[fmt]


def _read_json(path: str, findings: Findings) -> Optional[dict]:
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        findings.error(f"{os.path.basename(path)}: cannot read it ({type(e).__name__}: {e})")
        return None
    if not isinstance(data, dict):
        findings.error(f"{os.path.basename(path)}: holds a JSON {type(data).__name__}, not an object")
        return None
    return data


def check_files(export_dir: str, findings: Findings) -> dict[str, TensorInfo]:
    """Shards vs index (exactly the files present), no sidecars; returns every tensor's header."""
    names = sorted(os.listdir(export_dir))
    sidecars = [n for n in names if SIDECAR.match(n)]
    findings.errors_named("leftover per-layer sidecar file {} (ModelOpt export metadata) in the export", sidecars)
    if "config.json" not in names:
        findings.error("config.json is missing")
    tensors, duplicates = read_all_headers(export_dir)
    for d in duplicates:
        findings.error(d)
    present = set(safetensors_files(export_dir))
    if not present:
        findings.error("the export holds no .safetensors file")
    index = read_index(export_dir)
    if index is None:
        if present != {SINGLE_NAME}:
            findings.error(f"{INDEX_NAME} is missing but the export has shards {sorted(present)} "
                           f"(an unindexed checkpoint must be exactly {SINGLE_NAME})")
    else:
        weight_map = index["weight_map"]
        listed = set(weight_map.values())
        findings.errors_named(f"{INDEX_NAME} lists file {{}} which is missing from the export",
                              sorted(listed - present))
        findings.errors_named(f"shard {{}} is present but {INDEX_NAME} does not list it",
                              sorted(present - listed))
        wrong = sorted(k for k, f in weight_map.items() if f in present and
                       (k not in tensors or tensors[k].file != f))
        findings.errors_named(f"{INDEX_NAME} maps tensor {{}} to a shard that does not contain it", wrong)
        unindexed = sorted(k for k in tensors if k not in weight_map)
        findings.errors_named(f"tensor {{}} is stored in a shard but missing from {INDEX_NAME}", unindexed)
        total = sum(t.numel * DTYPE_BYTES.get(t.dtype, 0) for t in tensors.values())
        claimed = (index.get("metadata") or {}).get("total_size")
        if claimed is not None and int(claimed) != total and not (listed - present):
            findings.error(f"{INDEX_NAME} metadata.total_size={claimed} but the tensors hold {total} bytes")
    empty = sorted(k for k, t in tensors.items() if t.numel == 0)
    findings.errors_named("tensor {} is empty (0 elements)", [f"{k} {list(tensors[k].shape)}" for k in empty])
    findings.checks["files"] = {"shards": len(present), "tensors": len(tensors), "indexed": index is not None}
    return tensors


def check_quant_config(export_dir: str, fmt: str, findings: Findings) -> tuple[list[str], Optional[str], Optional[int]]:
    """config.json quantization_config and hf_quant_config.json vs the recipe.

    Returns (exclude_modules patterns, quant_algo, group size: the declared one when the
    quant_algo allows it, else the quant_algo's first)."""
    want = check_format_name(fmt)
    config = _read_json(os.path.join(export_dir, "config.json"), findings) or {}
    qc = config.get("quantization_config")
    hqc_path = os.path.join(export_dir, "hf_quant_config.json")
    if want is None:
        if qc is not None:
            findings.error(f"config.json has a quantization_config ({qc.get('quant_algo')!r}) but the recipe "
                           f"format is none")
        if os.path.exists(hqc_path):
            findings.error("hf_quant_config.json exists but the recipe format is none")
        findings.checks["quant_config"] = "none"
        return [], None, None
    hqc = _read_json(hqc_path, findings) if os.path.exists(hqc_path) else None
    if hqc is None:
        findings.error(f"hf_quant_config.json is missing (recipe format {fmt} needs quant_algo "
                       f"{' or '.join(want['quant_algo'])})")
        quant = {}
    else:
        quant = hqc.get("quantization") or {}
        if quant.get("quant_algo") not in want["quant_algo"]:
            findings.error(f"hf_quant_config.json quantization.quant_algo={quant.get('quant_algo')!r}, expected "
                           f"{' or '.join(want['quant_algo'])} for recipe format {fmt}")
    group_size = None
    if "group_size" in want:
        allowed = want["group_size"].get(quant.get("quant_algo"), next(iter(want["group_size"].values())))
        group_size = quant.get("group_size") if quant.get("group_size") in allowed else allowed[0]
        if hqc is not None and quant.get("group_size") not in allowed:
            findings.error(f"hf_quant_config.json quantization.group_size={quant.get('group_size')!r}, expected "
                           f"{' or '.join(map(str, allowed))} for recipe format {fmt} "
                           f"(quant_algo {quant.get('quant_algo')!r})")
    if qc is None:
        findings.error(f"config.json has no quantization_config (recipe format {fmt} needs quant_algo "
                       f"{' or '.join(want['quant_algo'])}): servers would load the checkpoint as unquantized")
    else:
        if qc.get("quant_algo") not in want["quant_algo"]:
            findings.error(f"config.json quantization_config.quant_algo={qc.get('quant_algo')!r}, expected "
                           f"{' or '.join(want['quant_algo'])} for recipe format {fmt}")
        elif quant and qc.get("quant_algo") != quant.get("quant_algo"):
            findings.error(f"config.json quantization_config.quant_algo={qc.get('quant_algo')!r} differs from "
                           f"hf_quant_config.json's {quant.get('quant_algo')!r}")
        if qc.get("quant_method") != "modelopt":
            findings.error(f"config.json quantization_config.quant_method={qc.get('quant_method')!r}, expected 'modelopt'")
        if "group_size" in want:
            groups = (qc.get("config_groups") or {}).values()
            sizes = sorted({(g.get("weights") or {}).get("group_size") for g in groups}, key=str)
            if sizes != [group_size]:
                findings.error(f"config.json quantization_config weight group_size {sizes}, expected "
                               f"[{group_size}] (hf_quant_config.json's)")
        if hqc is not None and sorted(qc.get("ignore") or []) != sorted(quant.get("exclude_modules") or []):
            findings.error("config.json quantization_config.ignore differs from hf_quant_config.json exclude_modules")
    excludes = list(quant.get("exclude_modules") or [])
    findings.checks["quant_config"] = {"quant_algo": quant.get("quant_algo"), "group_size": group_size,
                                       "exclude_modules": excludes}
    return excludes, quant.get("quant_algo"), group_size


def is_excluded(module: str, patterns: list[str]) -> bool:
    return any(module == p or fnmatch.fnmatchcase(module, p) for p in patterns)


def _is_embedding(module: str) -> bool:
    return module.rsplit(".", 1)[-1] in EMBEDDING_HINTS


def group_modules(tensors: dict[str, TensorInfo]) -> dict[str, dict[str, TensorInfo]]:
    modules: dict[str, dict[str, TensorInfo]] = {}
    for name, info in tensors.items():
        module, _, leaf = name.rpartition(".")
        modules.setdefault(module, {})[leaf] = info
    return modules


def _expect(findings: Findings, info: Optional[TensorInfo], name: str, dtype: str, shape=None, scalar=False):
    if info is None:
        findings.error(f"{name} is missing (quantized module needs it)")
        return
    if info.dtype != dtype:
        findings.error(f"{name} has dtype {info.dtype}, expected {dtype}")
    if scalar and info.numel != 1:
        findings.error(f"{name} has shape {list(info.shape)}, expected a scalar")
    if shape is not None and list(info.shape) != list(shape):
        findings.error(f"{name} has shape {list(info.shape)}, expected {list(shape)}")


def check_quantized_module(module: str, leaves: dict[str, TensorInfo], fmt: str, findings: Findings,
                           source_shape=None, weight_only: bool = False, block: int = 16) -> None:
    w = leaves["weight"]
    if source_shape is not None:
        out_f, in_f = source_shape
    elif fmt == "nvfp4":
        out_f, in_f = w.shape[0], w.shape[-1] * 2
    else:
        out_f, in_f = w.shape[0], w.shape[-1]
    if fmt == "nvfp4":
        if in_f % block:
            findings.error(f"{module}: in_features {in_f} is not a multiple of the NVFP4 block {block}")
        _expect(findings, w, f"{module}.weight", "uint8", [out_f, in_f // 2])
        _expect(findings, leaves.get("weight_scale"), f"{module}.weight_scale", "float8_e4m3fn", [out_f, in_f // block])
        _expect(findings, leaves.get("weight_scale_2"), f"{module}.weight_scale_2", "float32", scalar=True)
    else:
        _expect(findings, w, f"{module}.weight", "float8_e4m3fn", [out_f, in_f])
        _expect(findings, leaves.get("weight_scale"), f"{module}.weight_scale", "float32", scalar=True)
        if "weight_scale_2" in leaves:
            findings.error(f"{module}.weight_scale_2 is present but FP8 has a single weight scale")
    if weight_only:
        if "input_scale" in leaves:
            findings.error(f"{module}.input_scale is present but the checkpoint is weight-only")
    else:
        _expect(findings, leaves.get("input_scale"), f"{module}.input_scale", "float32", scalar=True)


def check_tensors(tensors: dict[str, TensorInfo], fmt: str, excludes: list[str], findings: Findings, *,
                  expected_dtype: Optional[str] = None, quantized_modules: Optional[set] = None,
                  source: Optional[dict[str, TensorInfo]] = None, weight_only: bool = False,
                  block: int = 16) -> dict[str, str]:
    """Quantized modules have the format's tensors; everything else stays high precision.

    ``quantized_modules`` (HF module names the Megatron model quantized) is the authority when
    given; otherwise every 2-D linear weight not matched by exclude_modules must be quantized.
    Returns module -> "quantized" | "excluded" | "high_precision".
    """
    kinds = {}
    unlisted: list[str] = []
    for module, leaves in sorted(group_modules(tensors).items()):
        if "weight" not in leaves:
            stray = sorted(set(leaves) & set(SCALE_LEAVES))
            findings.errors_named(f"{module}.{{}} has no {module}.weight next to it", stray)
            continue
        w = leaves["weight"]
        has_q = "weight_scale" in leaves or w.dtype in QUANTIZED_WEIGHT_DTYPES
        excluded = is_excluded(module, excludes)
        linear = len(w.shape) == 2 and not _is_embedding(module)
        if quantized_modules is not None:
            expected_q = module in quantized_modules
        else:
            expected_q = fmt != "none" and linear and not excluded
        src = source.get(f"{module}.weight") if source else None
        if has_q and fmt == "none":
            findings.error(f"{module}.weight is quantized ({w.dtype}) but the recipe format is none")
        elif has_q and excluded:
            findings.error(f"{module} is listed in exclude_modules but its weight is quantized ({w.dtype})")
        elif has_q and not expected_q:
            findings.error(f"{module}.weight is quantized ({w.dtype}) but the model did not quantize {module}")
        elif expected_q and not has_q and quantized_modules is not None:
            findings.error(f"{module}.weight stayed {w.dtype}: the recipe quantized {module} ({fmt}) but the "
                           f"export holds no quantized weight for it")
        elif expected_q and not has_q:
            unlisted.append(module)   # no Megatron authority: unquantized, and not declared so
        if has_q and fmt != "none":
            check_quantized_module(module, leaves, fmt, findings, src.shape if src is not None else None,
                                   weight_only, block)
            kinds[module] = "quantized"
            continue
        kinds[module] = "excluded" if excluded else "high_precision"
        if fmt != "none" and linear and not excluded and quantized_modules is not None and not has_q:
            unlisted.append(module)
        for leaf, info in leaves.items():
            if leaf in SCALE_LEAVES:
                findings.error(f"{module}.{leaf} exists but {module}.weight is not quantized")
            elif info.dtype not in HIGH_PRECISION:
                findings.error(f"{module}.{leaf} has dtype {info.dtype}; an unquantized tensor must be one of "
                               f"{list(HIGH_PRECISION)}")
            elif expected_dtype is not None and info.dtype != expected_dtype and leaf not in KV_SCALE_LEAVES:
                findings.error(f"{module}.{leaf} has dtype {info.dtype}, expected the export dtype {expected_dtype}")
    # a server quantizes every linear that exclude_modules does not name (vLLM reads it as the
    # ignore list): an unquantized linear missing from it would be loaded as quantized
    findings.errors_named(f"{{}} is an unquantized linear but hf_quant_config.json exclude_modules does not "
                          f"name it: a server would load it as {fmt}", unlisted)
    counts = {k: sum(1 for v in kinds.values() if v == k) for k in ("quantized", "excluded", "high_precision")}
    findings.checks["modules"] = counts
    return kinds


def source_under_export_names(source: dict[str, TensorInfo], tensors: dict[str, TensorInfo]) -> dict[str, TensorInfo]:
    """The source's tensors keyed by the names the export gives them.  A checkpoint may spell a
    tensor differently from ModelOpt's exporter (``modelopt_fixes.TENSOR_NAME_ALIASES``: e.g.
    transformers 5 saves Nemotron-H's ``backbone.embedding.weight``, the exporter writes the hub's
    ``backbone.embeddings.weight``); TensorInfo.name keeps the stored name for reading."""
    from launcher.megatron.modelopt_fixes import TENSOR_NAME_ALIASES

    out = dict(source)
    for canonical, aliases in TENSOR_NAME_ALIASES.items():
        for alias in aliases:
            if alias in out and canonical not in out and canonical in tensors and alias not in tensors:
                out[canonical] = out.pop(alias)
    return out


def check_names_vs_source(tensors: dict[str, TensorInfo], source: dict[str, TensorInfo], fmt: str,
                          kinds: dict[str, str], findings: Findings) -> None:
    """Every source tensor is exported; nothing but scale tensors of quantized modules is added."""
    missing = sorted(set(source) - set(tensors))
    findings.errors_named("tensor {} of the source checkpoint is missing from the export", missing)
    extra = []
    for name in sorted(set(tensors) - set(source)):
        module, _, leaf = name.rpartition(".")
        if fmt != "none" and leaf in SCALE_LEAVES + KV_SCALE_LEAVES and f"{module}.weight" in source:
            continue
        extra.append(name)
    findings.errors_named("tensor {} is in the export but not in the source checkpoint", extra)
    shape_errors = []
    for name in sorted(set(source) & set(tensors)):
        module = name.rpartition(".")[0]
        if kinds.get(module) == "quantized" and name.endswith(".weight"):
            continue  # checked against the source shape in check_quantized_module
        if tuple(source[name].shape) != tuple(tensors[name].shape):
            shape_errors.append(f"{name} {list(tensors[name].shape)} (source {list(source[name].shape)})")
    findings.errors_named("tensor {} has a different shape than in the source", shape_errors)
    findings.checks["names_vs_source"] = {"source_tensors": len(source), "missing": len(missing), "extra": len(extra)}


def check_tied_embeddings(config: dict, tensors: dict[str, TensorInfo], findings: Findings,
                          source_config: Optional[dict] = None, excludes: Optional[list[str]] = None) -> None:
    """Tied embeddings are written once: with ``tie_word_embeddings`` the export holds the
    embedding and no ``lm_head.weight``; without it, both.  The flag must equal the source's.
    ``excludes`` (a quantized export's exclude_modules): a tied output layer is the unquantized
    embedding, so the list must name ``lm_head``, or a server builds it quantized and waits for
    scales the checkpoint does not hold."""
    tied = tied_embeddings(config)
    if tied is None:
        return   # transformers' per-architecture default applies; nothing to compare
    source_tied = tied_embeddings(source_config) if source_config is not None else None
    if source_tied is not None and source_tied != tied:
        findings.error(f"config.json tie_word_embeddings={tied} but the source checkpoint says {source_tied}")
    heads = sorted(n for n in tensors if n == "lm_head.weight" or n.endswith(".lm_head.weight"))
    embeds = sorted(n for n in tensors if n.endswith(".weight") and _is_embedding(n[: -len(".weight")]))
    if tied and heads:
        findings.errors_named("{} is in the export but config.json ties the output layer to the embeddings "
                              f"({', '.join(embeds) or 'none found'}): written twice", heads)
    if not tied and embeds and not heads:
        findings.error("config.json does not tie the embeddings but the export has no lm_head.weight")
    if tied and excludes is not None and not is_excluded("lm_head", excludes):
        findings.error(f"config.json ties the output layer to the embeddings but hf_quant_config.json "
                       f"exclude_modules {excludes} does not name lm_head: a server (vLLM) would build lm_head "
                       f"quantized and find no scales for it")
    findings.checks["tied_embeddings"] = {"tied": tied, "lm_head_tensors": len(heads), "embedding_tensors": len(embeds)}


def model_dims(config: dict) -> tuple[Optional[int], int]:
    """(layers, experts) a config.json states; Nemotron-H's from its layer pattern in either
    format (transformers 5 writes layers_block_type and no num_hidden_layers)."""
    text = config.get("text_config") or config
    layers = text.get("num_hidden_layers")
    experts = 0
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        if text.get(key):
            experts = int(text[key])
            break
    if text.get("layers_block_type") or text.get("hybrid_override_pattern"):
        from launcher.hf_config import nemotron_h_pattern

        pattern = nemotron_h_pattern(text)
        layers = len(pattern)
        experts = experts if "E" in pattern else 0
    return layers, experts


def check_layers_and_experts(tensors: dict[str, TensorInfo], num_layers: int, num_experts: int,
                             findings: Findings) -> None:
    """Every layer 0..L-1 is present; in every MoE layer every expert has the same tensors."""
    layers: dict[int, list[str]] = {}
    for name in tensors:
        m = LAYER_RE.search(name)
        if m:
            layers.setdefault(int(m.group(1)), []).append(name)
    missing = [str(i) for i in range(num_layers) if i not in layers]
    findings.errors_named("layer {} of the model card has no tensor in the export", missing)
    extra = sorted(i for i in layers if i >= num_layers)
    findings.errors_named(f"layer {{}} is in the export but the model card has {num_layers} layers", [str(i) for i in extra])
    moe_layers = 0
    for layer, names in sorted(layers.items()):
        experts: dict[tuple, dict[int, set]] = {}
        for name in names:
            m = EXPERT_RE.match(name)
            if m:
                experts.setdefault((m.group(1),), {}).setdefault(int(m.group(2)), set()).add(m.group(3))
        for (prefix,), by_id in experts.items():
            moe_layers += 1
            ids = set(by_id)
            findings.errors_named(f"{prefix}.{{}} (expert of layer {layer}) is missing: the model card has "
                                  f"{num_experts} experts", [str(i) for i in range(num_experts) if i not in ids])
            findings.errors_named(f"{prefix}.{{}} is beyond the model card's {num_experts} experts",
                                  [str(i) for i in sorted(ids) if i >= num_experts])
            union = set().union(*by_id.values())
            holes = [f"{prefix}.{i}.{leaf}" for i in sorted(by_id) for leaf in sorted(union - by_id[i])]
            findings.errors_named("tensor {} is missing (the other experts of this layer have it)", holes)
    if num_experts and not moe_layers:
        findings.error(f"the model card has {num_experts} experts but no tensor of the export is an expert's")
    findings.checks["layers"] = {"num_layers": num_layers, "num_experts": num_experts, "moe_layers": moe_layers}


def size_report(export_dir: str, tensors: dict[str, TensorInfo], kinds: dict[str, str], fmt: str,
                source_dir: Optional[str], source: Optional[dict[str, TensorInfo]]) -> dict:
    """Bytes of the export vs the same model in bf16 (from the source, else from logical shapes)."""
    export_bytes = sum(os.path.getsize(os.path.join(export_dir, f)) for f in safetensors_files(export_dir))
    if source is not None:
        params = sum(t.numel for t in source.values())
        src_bytes = sum(os.path.getsize(os.path.join(source_dir, f)) for f in safetensors_files(source_dir))
    else:
        params = 0
        for name, t in tensors.items():
            module, _, leaf = name.rpartition(".")
            if leaf in SCALE_LEAVES + KV_SCALE_LEAVES:
                continue
            packed = kinds.get(module) == "quantized" and leaf == "weight" and fmt == "nvfp4"
            params += t.numel * (2 if packed else 1)
        src_bytes = None
    bf16 = 2 * params
    return {"export_bytes": export_bytes, "bf16_bytes": bf16, "source_bytes": src_bytes, "params": params,
            "ratio_vs_bf16": round(export_bytes / bf16, 4) if bf16 else None}
