"""Verify an exported HF checkpoint: ``verify_export`` (a dict for verify.json) and the CLI.

What it proves (each failure names the tensor, module or file):
  files     the safetensors index covers exactly the shards present, every tensor is indexed in
            the shard that holds it, no per-layer sidecar .json is left, no tensor is empty;
  config    config.json quantization_config and hf_quant_config.json match the recipe format;
  tensors   every quantized module has its format's tensors, dtypes and shapes; excluded and
            other unquantized tensors stay high precision; with the Megatron model's list of
            quantized modules, exactly those are quantized;
  names     every layer and expert of the model card is present; with the source checkpoint,
            every source tensor is exported and nothing else is added but scales; tied
            embeddings (tie_word_embeddings, as in the source) are written once, no lm_head;
  values    recipe none + source: bit-exact round trip; quantized + source: dequantized samples
            close to the source; with Megatron references: dequantized == fake-quantized weights;
  size      export bytes vs the model in bf16.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Optional

from launcher import formats
from launcher.export import verify_layout as layout
from launcher.export.safetensors_dir import checkpoint_tensor_names
from launcher.hf_config import read_hf_config_if_present

QUANT_ALGO_FORMATS = formats.quant_algo_formats()   # {"NVFP4": "nvfp4", "W4A16_NVFP4": "nvfp4", "FP8": "fp8"}


def _guarded(findings, what: str, fn, *args, **kwargs):
    """Run a value check; an exception becomes a finding (a corrupt export must not crash verify)."""
    try:
        fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - reported, with the check's name
        findings.error(f"{what} could not run: {type(e).__name__}: {e}")


def verify_export(export_dir: str, fmt: str, *, source_dir: Optional[str] = None,
                  num_layers: Optional[int] = None, num_experts: Optional[int] = None,
                  expected_dtype: Optional[str] = None, quantized_modules: Optional[set] = None,
                  quantize_experts: bool = False, reference_results: Optional[list] = None,
                  samples: int = 4) -> dict:
    """Check ``export_dir`` against the recipe ``fmt`` (nvfp4 | fp8 | none); return the report.

    ``num_layers`` / ``num_experts`` come from the model card (default: the export's config.json,
    which is then also the only authority).  ``reference_results`` are ``compare_references``
    outputs gathered from the ranks holding the Megatron model.
    """
    layout.check_format_name(fmt)
    if not os.path.isdir(export_dir):
        raise ValueError(f"export directory {export_dir!r} does not exist")
    if source_dir is not None and not os.path.isdir(source_dir):
        raise ValueError(f"source checkpoint {source_dir!r} does not exist")
    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    t0 = time.time()
    findings = layout.Findings()
    warnings: list[str] = []
    tensors = layout.check_files(export_dir, findings)
    excludes, algo, group_size = layout.check_quant_config(export_dir, fmt, findings)
    config = {}
    if os.path.isfile(os.path.join(export_dir, "config.json")):   # unreadable: a finding, named
        config = layout._read_json(os.path.join(export_dir, "config.json"), findings) or {}
    cfg_layers, cfg_experts = layout.model_dims(config)
    for what, card, exported in (("num_layers", num_layers, cfg_layers), ("num_experts", num_experts, cfg_experts)):
        if card is not None and exported is not None and card != exported:
            findings.error(f"config.json says {what}={exported} but the model card says {card}")
    num_layers = num_layers if num_layers is not None else cfg_layers
    num_experts = num_experts if num_experts is not None else cfg_experts
    source = layout.source_under_export_names(checkpoint_tensor_names(source_dir), tensors) if source_dir else None
    kinds = layout.check_tensors(tensors, fmt, excludes, findings, expected_dtype=expected_dtype,
                                 quantized_modules=quantized_modules, source=source,
                                 weight_only=algo in layout.WEIGHT_ONLY_ALGOS, block=group_size or 16)
    if quantize_experts and fmt != "none":
        from launcher.export.verify_values import module_kind

        unq = sorted(m for m, k in kinds.items() if k != "quantized" and module_kind(m) == "expert")
        findings.errors_named("expert {} is not quantized but the recipe quantizes every expert", unq)
    if source is not None:
        layout.check_names_vs_source(tensors, source, fmt, kinds, findings)
    source_config = read_hf_config_if_present(source_dir) if source_dir else None
    layout.check_tied_embeddings(config, tensors, findings, source_config,
                                 excludes if fmt != "none" else None)
    if num_layers is None:
        findings.error("cannot check layers: no num_layers in the model card or config.json")
    else:
        layout.check_layers_and_experts(tensors, num_layers, num_experts or 0, findings)
    hp = sorted({t.dtype for n, t in tensors.items() if kinds.get(n.rpartition(".")[0]) != "quantized"
                 and t.dtype in layout.HIGH_PRECISION and not n.endswith(layout.SCALE_LEAVES)})
    declared = config.get("dtype") or config.get("torch_dtype")
    if declared and hp and hp != [declared]:
        warnings.append(f"config.json declares dtype {declared} but the unquantized tensors are {hp}")

    if not findings.errors:  # values are only meaningful on a structurally sound export
        from launcher.export import verify_values as values

        if source is not None and fmt == "none":
            _guarded(findings, "round trip vs the source", values.roundtrip_vs_source,
                     export_dir, source_dir, tensors, source, findings)
        elif source is not None:
            _guarded(findings, "dequantized weights vs the source", values.quantized_vs_source,
                     export_dir, source_dir, tensors, source, kinds, fmt, samples, findings)
        if reference_results is not None:
            values.summarize_references(reference_results, findings, fmt)
        elif fmt != "none":
            warnings.append("dequantized weights were not compared with a Megatron model (no references)")
    size = layout.size_report(export_dir, tensors, kinds, fmt, source_dir, source)
    return {
        "ok": not findings.errors,
        "export_dir": os.path.abspath(export_dir),
        "format": fmt,
        "quant_algo": algo,
        "source_dir": os.path.abspath(source_dir) if source_dir else None,
        "errors": findings.errors,
        "warnings": warnings,
        "checks": findings.checks,
        "size": size,
        "seconds": round(time.time() - t0, 3),
    }


def format_of_recipe(name: str) -> str:
    """A recipe name (recipes/<name>.yaml) or a format name -> the format to verify."""
    if name in layout.FORMATS:
        return name
    from omegaconf import OmegaConf

    from launcher.paths import RECIPES_DIR, recipe_names

    if name not in recipe_names():
        raise ValueError(f"--recipe {name!r} is neither a recipe ({', '.join(recipe_names())}) nor a format "
                         f"({', '.join(sorted(layout.FORMATS))})")
    fmt = OmegaConf.load(os.path.join(RECIPES_DIR, f"{name}.yaml")).get("format")
    layout.check_format_name(fmt)
    return fmt


def format_from_export(export_dir: str) -> str:
    path = os.path.join(export_dir, "hf_quant_config.json")
    if not os.path.isfile(path):
        return "none"
    try:
        with open(path) as f:
            algo = (json.load(f).get("quantization") or {}).get("quant_algo")
    except (json.JSONDecodeError, AttributeError) as e:
        raise ValueError(f"{path}: not a JSON object with quantization.quant_algo ({e})") from e
    if algo not in QUANT_ALGO_FORMATS:
        raise ValueError(f"{path}: quant_algo {algo!r} cannot be verified; supported: {sorted(QUANT_ALGO_FORMATS)}")
    return QUANT_ALGO_FORMATS[algo]


def verify_export_main(argv=None) -> int:
    """``launch verify EXPORT_DIR [--recipe NAME] [--source HF_DIR]``: 0 verified, 1 failed, 2 usage."""
    p = argparse.ArgumentParser(prog="launch verify", description="Verify an exported HF checkpoint.")
    p.add_argument("export_dir")
    p.add_argument("--recipe", help="recipe name or format (nvfp4|fp8|none); default: from hf_quant_config.json")
    p.add_argument("--source", help="the source HF checkpoint: exact names, shapes, round trip, dequant error")
    p.add_argument("--num-layers", type=int, help="model card's layers (default: config.json)")
    p.add_argument("--num-experts", type=int, help="model card's experts (default: config.json)")
    p.add_argument("--samples", type=int, default=4, help="modules per kind for value checks")
    p.add_argument("--json", help="also write the report to this file")
    args = p.parse_args(argv)
    try:
        fmt = format_of_recipe(args.recipe) if args.recipe else format_from_export(args.export_dir)
        report = verify_export(args.export_dir, fmt, source_dir=args.source, num_layers=args.num_layers,
                               num_experts=args.num_experts, samples=args.samples)
    except ValueError as e:
        print(f"launch verify: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2, default=str)
    size = report["size"]
    print(f"{report['export_dir']}: format {fmt} (quant_algo {report['quant_algo']}), "
          f"{report['checks'].get('files', {}).get('tensors')} tensors, {size['export_bytes']} bytes "
          f"= {size['ratio_vs_bf16']} x bf16")
    for w in report["warnings"]:
        print(f"  warning: {w}")
    for e in report["errors"]:
        print(f"  FAIL: {e}")
    print("VERIFIED" if report["ok"] else f"NOT VERIFIED: {len(report['errors'])} problem(s)")
    return 0 if report["ok"] else 1
