"""Fold fake-quantized weights for evaluation: each enabled weight quantizer runs once.

A ModelOpt-quantized Megatron model recomputes ``weight_quantizer(weight)`` in every forward of
every linear (``_QuantLinear.quantized_linear_fn``).  The weights are constant during the gate,
so ``fold_weight_quantizers`` computes that once per module, stores it in the weight and
disables the weight quantizer; input (activation) quantizers stay as they are.

Equivalent to ModelOpt's ``mtq.fold_weight`` with one difference that matters on a GPU:
``mtq.fold_weight`` quantizes an fp32 copy of the weight (``quantizer(weight.float())``), while
a forward quantizes the weight in its own dtype (bf16 there) - a different input to ModelOpt's
kernels.  Here the quantizer gets exactly what the forward gives it, so the folded weight is
bit-identical to what every unfolded forward computed, and to the reference the export
verifier compares the exported weights with (``launcher.export.megatron_ref``:
``weight_quantizer(weight)`` on the reloaded quantize checkpoint).  The export stage never sees
a folded model: it reloads ``quantize/checkpoint`` in its own process.

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


def fold_weight_quantizers(model) -> dict[str, Any]:
    """Fold every enabled fake-quant ``weight_quantizer`` of ``model`` into its ``weight``.

    Returns {"folded": n, "modules": [names], "skipped_shared": [names]}.
    """
    import torch

    uses: dict[int, int] = {}   # tensor start address -> parameters starting there (tied weights)
    for _, p in model.named_parameters(remove_duplicate=False):
        uses[p.data_ptr()] = uses.get(p.data_ptr(), 0) + 1
    folded, skipped = [], []
    with torch.no_grad():
        for name, module in model.named_modules():
            q = getattr(module, "weight_quantizer", None)
            w = getattr(module, "weight", None)
            if not isinstance(w, torch.Tensor) or not _enabled_fake_quant(q):
                continue
            if uses.get(w.data_ptr(), 0) > 1:
                skipped.append(name)
                continue
            w.data.copy_(q(w))
            _disable(q)
            folded.append(name)
    return {"folded": len(folded), "modules": folded, "skipped_shared": skipped}
