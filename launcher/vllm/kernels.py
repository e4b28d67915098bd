"""Which kernels vLLM chose for an export, read from its own log (pure; no vLLM import).

vLLM states each choice once, at load time, in lines such as

    Using 'MARLIN' NvFp4 MoE backend out of potential backends: ['FLASHINFER_TRTLLM', ...].
    Using MarlinNvFp4LinearKernel for NVFP4 GEMM
    Selected CutlassFP8ScaledMMLinearKernel for ModelOptFp8LinearMethod
    Using FLASH_ATTN attention backend out of potential backends: [...]

``read_choices`` returns those statements (deduplicated, in log order, with the logger's prefix
and the list of candidates removed) and ``family`` names the kernel family that served the
quantized weights: ``marlin``, ``cutlass``, ``flashinfer``, ``triton``, ``emulation`` or
``unquantized`` (no quantized-kernel statement found), so a report can say that an NVFP4 export
on Hopper ran through Marlin's W4A16 path rather than a native FP4 kernel.
"""
from __future__ import annotations

import os
import re
from typing import Iterable

# "Using X for Y", "Using 'X' ... backend", "Selected X for Y"; the logger prefix is dropped
_CHOICE = re.compile(r"\b((?:Using|Selected)\s+'?[\w.\-]+'?\s+(?:for\s+[\w .\-]+|[\w ]*?backend\b))")
_CANDIDATES = re.compile(r"\s+out of potential backends.*$")
# the families, in the order a statement is tested against them (the first match names it)
_FAMILIES = (("emulation", re.compile(r"emulat", re.I)), ("marlin", re.compile(r"marlin", re.I)),
             ("flashinfer", re.compile(r"flashinfer", re.I)), ("cutlass", re.compile(r"cutlass", re.I)),
             ("triton", re.compile(r"triton", re.I)))
_QUANTIZED = re.compile(r"NvFp4|NVFP4|FP8|Fp8|FP4|Fp4|MoE backend|ScaledMM", re.I)


def read_choices(lines: Iterable[str]) -> list[str]:
    """vLLM's kernel and backend statements in ``lines``, each once, in order."""
    seen: dict[str, None] = {}
    for line in lines:
        m = _CHOICE.search(line)
        if m:
            seen.setdefault(_CANDIDATES.sub("", m.group(1)).strip().rstrip("."), None)
    return list(seen)


def family(choices: Iterable[str]) -> str:
    """The kernel family of the quantized layers' statements (see the module docstring)."""
    quantized = [c for c in choices if _QUANTIZED.search(c) and "attention" not in c.lower()]
    if not quantized:
        return "unquantized"
    for name, rx in _FAMILIES:
        if any(rx.search(c) for c in quantized):
            return name
    return "other"


def log_size(path: str) -> int:
    """Where the next attempt's lines will start in an appended log (0: no log yet)."""
    try:
        return os.path.getsize(path)
    except FileNotFoundError:
        return 0


def read_log(path: str, start: int = 0) -> dict:
    """``{"choices": [...], "family": ...}`` of a vLLM log file from byte ``start`` on (the stage's
    log is appended to by every attempt: ``start`` = ``log_size`` before this attempt's engine
    started, so an earlier attempt's kernels are never reported as this one's); empty choices if
    the log is absent."""
    try:
        with open(path, "rb") as f:
            f.seek(start)
            choices = read_choices(line.decode("utf-8", errors="replace") for line in f)
    except FileNotFoundError:
        choices = []
    return {"choices": choices, "family": family(choices)}


def precision_note(kernel_family: str) -> str | None:
    """Why a quantized export's served predictions may differ from the gate's beyond rounding: Marlin
    (vLLM's kernel for FP4 and FP8 weights on GPUs without native support, e.g. NVFP4 on Hopper) is
    weight-only, its activations stay in 16 bits, while the gate fake-quantizes activations too.
    None for the other families (served at the export's own precision, or unquantized)."""
    if kernel_family == "marlin":
        return ("vLLM served the quantized weights through Marlin, weight-only (activations in 16 bits), "
                "while the gate quantized activations too: the export is not served at its own precision here; "
                "stages.vllm_smoke.nvfp4_kernels=emulation serves an NVFP4 export at it")
    return None


# vLLM's engine flags that select its NVFP4 emulation for dense and MoE layers (vLLM 0.26:
# EmulationNvFp4LinearKernel and the EMULATION NvFp4 MoE backend quantize the activations to NVFP4
# with the checkpoint's input scales, then dequantize and multiply in 16 bits)
EMULATION_ARGS = ("--linear-backend", "emulation", "--moe-backend", "emulation")


def serving_args(nvfp4_kernels: str, quant_algo: str | None) -> list[str]:
    """The engine flags that ``stages.vllm_smoke.nvfp4_kernels`` adds for an export of ``quant_algo``:
    none for ``auto`` or an export that is not NVFP4 (vLLM has no FP8 emulation to select)."""
    if nvfp4_kernels == "emulation" and quant_algo == "NVFP4":
        return list(EMULATION_ARGS)
    return []
