"""Value checks of an exported checkpoint: round trip, dequantized weights vs references.

* ``roundtrip_vs_source``: recipe ``none`` - every tensor equals the source checkpoint's, bit for
  bit (the source cast to the export's dtype when they differ; the cast is reported).
* ``quantized_vs_source``: dequantized sampled weights vs the source's high-precision weights;
  a relative error above ``SOURCE_REL_ERR_MAX`` means the wrong weights went into that tensor
  (a mis-mapped expert has relative error ~1.4; honest NVFP4 rounding ~0.1, FP8 ~0.02).
* ``compare_references``: dequantized weights vs references computed from the in-memory
  Megatron model (``megatron_ref``: the weight the gate evaluated, i.e. the exporter's own
  arithmetic on the reloaded checkpoint, dequantized), compared in the reference's dtype.  The
  stated tolerance: every element within ``ULP_BUDGET`` (4) units in the last place of the
  reference dtype (the order of the dequantization's multiplications), and no element rounded to
  another representable value: ``MAX_FLIP_FRACTION`` is 0 for every format, since the gate folds
  the same codes the export writes (``launcher.megatron.fold``).  A flip therefore means the
  exported checkpoint is not the model the gate passed.  ``flip_blocks`` counts the NVFP4 blocks
  (16 or 32 elements) flips fall in, and ``over`` the elements more than one quantization step
  off (wrong data, e.g. another expert's weights).
"""
from __future__ import annotations

import re
from typing import Optional

from launcher.export.dequant import dequantize_module, nvfp4_block_size
from launcher.export.safetensors_dir import TensorInfo, load_tensors
from launcher.export.verify_layout import Findings

# Max relative Frobenius error of dequantized weights vs the source high-precision weights.
SOURCE_REL_ERR_MAX = {"nvfp4": 0.25, "fp8": 0.08}
# Differences up to ULP_BUDGET units in the last place of the reference dtype are the order of
# the dequantization's multiplications; beyond that an element was rounded to another value,
# which no element may be: the gate evaluated the exporter's own codes.
ULP_BUDGET = 4
MAX_FLIP_FRACTION = {"nvfp4": 0.0, "fp8": 0.0, "none": 0.0}
NVFP4_BLOCK = 16


def max_flip_fraction(fmt: str) -> float:
    return MAX_FLIP_FRACTION.get(fmt, 0.0)

_KIND_RULES = (
    ("expert", re.compile(r"\.experts\.\d+\.")),
    ("shared_expert", re.compile(r"\.shared_experts?\.")),
    ("attention", re.compile(r"\.(self_attn|attention|attn|mixer)\.(q_proj|k_proj|v_proj|o_proj|qkv_proj|dense)$")),
    ("dense_mlp", re.compile(r"\.mlp\.(gate_proj|up_proj|down_proj|fc1|fc2)$")),
)


def module_kind(module: str) -> str:
    for kind, rule in _KIND_RULES:
        if rule.search(module):
            return kind
    return "other"


def sample_modules(modules: list[str], per_kind: int) -> dict[str, list[str]]:
    """Deterministic spread-out sample of ``per_kind`` modules of each kind (sorted input order)."""
    by_kind: dict[str, list[str]] = {}
    for m in sorted(modules):
        by_kind.setdefault(module_kind(m), []).append(m)
    out = {}
    for kind, names in by_kind.items():
        n = min(per_kind, len(names))
        step = len(names) / n if n else 1
        # offset by i so that consecutive picks rotate through a module's siblings (q/k/v, gate/up/down)
        out[kind] = sorted({names[min(len(names) - 1, int(i * step) + i % max(int(step), 1))] for i in range(n)})
    return out


def _bits(t):
    import torch

    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return t.view(torch.uint8)
    return t


def roundtrip_vs_source(export_dir: str, source_dir: str, tensors: dict[str, TensorInfo],
                        source: dict[str, TensorInfo], findings: Findings) -> None:
    """Recipe none: every exported tensor equals the source tensor bit for bit."""
    import torch

    common = sorted(set(tensors) & set(source))
    casts: dict[str, int] = {}
    exact = 0
    for i in range(0, len(common), 64):
        names = common[i:i + 64]
        got = load_tensors(export_dir, names, tensors)
        want = load_tensors(source_dir, names, source)
        for name in names:
            g, w = got[name], want[name]
            if g.dtype != w.dtype:
                key = f"{str(w.dtype).replace('torch.', '')}->{str(g.dtype).replace('torch.', '')}"
                casts[key] = casts.get(key, 0) + 1
                w = w.to(g.dtype)
            if g.shape == w.shape and torch.equal(_bits(g), _bits(w)):
                exact += 1
                continue
            diff = (g.float() - w.float()).abs().max().item() if g.shape == w.shape else None
            findings.error(f"round trip: tensor {name} differs from the source "
                           f"(max |diff| {diff}, shapes {list(g.shape)} vs {list(w.shape)})")
    findings.checks["roundtrip"] = {"compared": len(common), "bit_exact": exact, "dtype_casts": casts}


def dequantized(export_dir: str, modules: list[str], tensors: dict[str, TensorInfo], fmt: str,
                with_steps: bool = False):
    """module -> fp32 dequantized weight (and module -> quantization step when ``with_steps``)."""
    from launcher.export.dequant import quantization_step

    leaves = ("weight", "weight_scale", "weight_scale_2")
    names = [f"{m}.{leaf}" for m in modules for leaf in leaves if f"{m}.{leaf}" in tensors]
    loaded = load_tensors(export_dir, names, tensors)
    out, steps = {}, {}
    for m in modules:
        parts = {leaf: loaded[f"{m}.{leaf}"] for leaf in leaves if f"{m}.{leaf}" in loaded}
        out[m] = dequantize_module(fmt, parts)
        if with_steps:
            steps[m] = quantization_step(fmt, parts)
    return (out, steps) if with_steps else out


def quantized_vs_source(export_dir: str, source_dir: str, tensors: dict[str, TensorInfo],
                        source: dict[str, TensorInfo], kinds: dict[str, str], fmt: str, per_kind: int,
                        findings: Findings) -> None:
    """Dequantized sampled modules are close to the source weights (catches mis-mapped tensors)."""
    quantized = [m for m, k in kinds.items() if k == "quantized" and f"{m}.weight" in source]
    samples = sample_modules(quantized, per_kind)
    flat = [m for names in samples.values() for m in names]
    deq = dequantized(export_dir, flat, tensors, fmt)
    ref = load_tensors(source_dir, [f"{m}.weight" for m in flat], source)
    bound = SOURCE_REL_ERR_MAX[fmt]
    result = {}
    for kind, names in samples.items():
        errs = {}
        for m in names:
            w = ref[f"{m}.weight"].float()
            rel = float((deq[m] - w).norm() / w.norm().clamp_min(1e-30))
            errs[m] = round(rel, 5)
            if not rel <= bound:
                findings.error(f"{m}: dequantized weight is far from the source weight (relative error "
                               f"{rel:.3f} > {bound} for {fmt}): wrong data in {m}.weight")
        result[kind] = {"max_rel_err": max(errs.values()) if errs else None, "modules": errs}
    findings.checks["dequant_vs_source"] = {"bound": bound, "by_kind": result}


def compare_references(export_dir: str, references: dict, fmt: str,
                       tensors: Optional[dict[str, TensorInfo]] = None) -> list[dict]:
    """Compare exported modules with ``references`` (HF module name -> (kind, tensor)).

    Runs on whichever rank computed the references; returns one small dict per module
    (gathered to rank 0 by the stage).  ``tensors`` defaults to the export's headers.
    """
    import torch

    from launcher.export.safetensors_dir import read_all_headers

    if tensors is None:
        tensors, _ = read_all_headers(export_dir)
    results = []
    present = [m for m in references if f"{m}.weight" in tensors]
    for m in sorted(set(references) - set(present)):
        results.append({"module": m, "kind": references[m][0], "error": f"{m}.weight is not in the export"})
    quantized = [m for m in present if f"{m}.weight_scale" in tensors]
    deq, steps = dequantized(export_dir, quantized, tensors, fmt, with_steps=True) \
        if quantized and fmt != "none" else ({}, {})
    plain = load_tensors(export_dir, [f"{m}.weight" for m in present if m not in deq], tensors)
    for m in sorted(present):
        kind, ref = references[m]
        got = deq[m] if m in deq else plain[f"{m}.weight"]
        entry = {"module": m, "kind": kind, "quantized": m in deq, "dtype": str(ref.dtype).replace("torch.", "")}
        if tuple(got.shape) != tuple(ref.shape):
            entry["error"] = f"{m}: exported weight shape {list(got.shape)} != Megatron's {list(ref.shape)}"
            results.append(entry)
            continue
        ref32 = ref.float()
        diff = (got.to(ref.dtype).float() - ref32).abs()
        eps = torch.finfo(ref.dtype).eps if ref.is_floating_point() else 0.0
        ulps = ULP_BUDGET * eps * ref32.abs()           # arithmetic-order differences
        step = steps[m] if m in steps else torch.zeros_like(ref32)
        flipped = diff > ulps                              # elements rounded to another value
        flips = int(flipped.sum())
        over = int((diff > step + ulps).sum())             # beyond one quantization step: wrong data
        entry.update(max_abs_diff=diff.max().item(), elements=diff.numel(),
                     mismatched=int((diff != 0).sum()), flips=flips, bit_exact=bool((diff == 0).all()))
        block = nvfp4_block_size(tensors[f"{m}.weight"], tensors[f"{m}.weight_scale"]) \
            if fmt == "nvfp4" and m in deq else NVFP4_BLOCK
        if flips and fmt == "nvfp4" and m in deq and ref.shape[-1] % block == 0:
            blocks = flipped.reshape(*ref.shape[:-1], -1, block)
            entry["flip_blocks"] = int(blocks.any(dim=-1).sum())
            entry["blocks"] = blocks.numel() // block
        allowed = max_flip_fraction(fmt)
        if over or flips > allowed * diff.numel():
            what = "gated (exporter-arithmetic) weight" if m in deq else "weight"
            rule = (f"allowed: <= {allowed:g} of the elements, each within one step" if allowed
                    else "allowed: none, the gate folds the codes the export writes")
            entry["error"] = (f"{m}: exported weight differs from the Megatron model's {what}: {flips} of "
                              f"{diff.numel()} elements rounded differently (max |diff| "
                              f"{entry['max_abs_diff']:.3e}), {over} of them beyond one quantization step "
                              f"({rule})")
        results.append(entry)
    return results


def summarize_references(results: list[dict], findings: Findings, fmt: str) -> None:
    by_kind: dict[str, dict] = {}
    for r in results:
        if "error" in r:
            findings.error(r["error"])
        k = by_kind.setdefault(r["kind"], {"modules": 0, "bit_exact": 0, "max_abs_diff": 0.0,
                                           "elements": 0, "mismatched": 0, "flips": 0})
        k["modules"] += 1
        k["bit_exact"] += int(bool(r.get("bit_exact")))
        k["elements"] += r.get("elements", 0)
        k["mismatched"] += r.get("mismatched", 0)
        k["flips"] += r.get("flips", 0)
        if r.get("max_abs_diff") is not None:
            k["max_abs_diff"] = max(k["max_abs_diff"], r["max_abs_diff"])
    findings.checks["dequant_vs_megatron"] = {
        "tolerance": (f"each element within {ULP_BUDGET} ulps of the reference dtype, except <= "
                      f"{max_flip_fraction(fmt):g} of the elements within one quantization step"
                      if max_flip_fraction(fmt) else
                      f"each element within {ULP_BUDGET} ulps of the reference dtype; no rounding flips"),
        "by_kind": by_kind, "modules": [r["module"] for r in results]}
