"""Fold fake-quantized weights for evaluation: each enabled weight quantizer runs once.

A ModelOpt-quantized Megatron model recomputes ``weight_quantizer(weight)`` in every forward of
every linear (``_QuantLinear.quantized_linear_fn``).  The weights are constant during the gate,
so ``fold_weight_quantizers`` computes that once per module, stores it in the weight and
disables the weight quantizer; input (activation) quantizers stay as they are.

The folded weight is the one the HF export will store, dequantized
(``launcher.megatron.exported_weights.exported_weight``: ModelOpt's exporter arithmetic on the
module), not ``weight_quantizer(weight)``: on a GPU the fake-quant kernel breaks rounding ties
differently from the exporter, and the gate must evaluate the checkpoint that ships.  The export
verifier compares the exported files with the same function on the reloaded checkpoint
(``launcher.export.megatron_ref``), so its 0 flips say the gate evaluated those bytes.  On CPU
both arithmetics agree bit for bit, so the folded weight also equals every unfolded forward's
(tests/test_eval_fast_paths.py).  A weight quantizer whose format the exporter does not pack is
folded as ``weight_quantizer(weight)``.  The export stage never sees a folded model: it reloads
``quantize/checkpoint`` in its own process.

Folding is irreversible (the gate's model is discarded after the stage).  A weight shared with
another parameter (tied embeddings) is never folded; ``fold_weight_quantizers`` reports it.
"""
from __future__ import annotations

from typing import Any


def _enabled_fake_quant(q) -> bool:
    if q is None:
        return False
    subs = list(q) if hasattr(q, "__iter__") and not hasattr(q, "_num_bits") else [q]
    return any(getattr(s, "is_enabled", False) and getattr(s, "fake_quant", True) for s in subs)


def _disable(q) -> None:
    subs = list(q) if hasattr(q, "__iter__") and not hasattr(q, "_num_bits") else [q]
    for s in subs:
        s.disable()


def fold_weight_quantizers(model, export_dtype=None) -> dict[str, Any]:
    """Fold every enabled fake-quant ``weight_quantizer`` of ``model`` into its ``weight``, as
    the export (in ``export_dtype``; default each weight's own) will write it.

    Returns {"folded": n, "modules": [names], "skipped_shared": [names], "as_exported": n}.
    """
    import torch

    from launcher.megatron.exported_weights import exported_format, gated_weight

    uses: dict[int, int] = {}   # tensor start address -> parameters starting there (tied weights)
    for _, p in model.named_parameters(remove_duplicate=False):
        uses[p.data_ptr()] = uses.get(p.data_ptr(), 0) + 1
    folded, skipped, as_exported = [], [], 0
    with torch.no_grad():
        for name, module in model.named_modules():
            q = getattr(module, "weight_quantizer", None)
            w = getattr(module, "weight", None)
            if not isinstance(w, torch.Tensor) or not _enabled_fake_quant(q):
                continue
            if uses.get(w.data_ptr(), 0) > 1:
                skipped.append(name)
                continue
            as_exported += exported_format(module) is not None
            w.data.copy_(gated_weight(module, export_dtype))
            _disable(q)
            folded.append(name)
    return {"folded": len(folded), "modules": folded, "skipped_shared": skipped, "as_exported": as_exported}
