"""The register of every process-wide patch a rank makes to torch, Megatron-Core, ModelOpt or
``sys.modules``: one table, each entry with its name, the reason, the condition it applies under
and how it is undone.

A patch is a function ``install(rec) -> bool | None`` in the module that owns the subject
(``cpu_compat``, ``modelopt_fixes``, ``grouped_experts``, ``mamba_ssm_compat``).  It changes
process state only through the recorder ``rec`` (``rec.set(obj, attr, value)``,
``rec.set_item(mapping, key, value)``), which keeps the originals, so ``undo(name)`` puts back
exactly what was there.  It returns False when there is nothing to patch here (mamba_ssm absent,
its real extension present): such a patch is not recorded as applied.

``apply(name)`` is idempotent.  A CPU-only patch refuses to apply in a process that can see a
CUDA device (``PatchRefused``, a RuntimeError the worker reports as a preflight failure, exit
5): replacing ``torch.cuda.*`` there would silently break the real CUDA paths.  Ranks of
``executor.device=cpu`` are started with ``CUDA_VISIBLE_DEVICES=`` so that this never happens on
a GPU host.  ``applied()`` is what a stage records in its manifest.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable

from launcher.contract import ExitCode


class PatchRefused(RuntimeError):
    """A patch asked for in a process where it must not run (e.g. a CPU shim with CUDA visible)."""

    exit_code = ExitCode.PREFLIGHT


@dataclass(frozen=True)
class Patch:
    name: str
    target: str          # "module:function" installing it: install(rec) -> bool | None
    reason: str          # what breaks without it
    condition: str       # when the launcher applies it
    cpu_only: bool = False


_CPU = "launcher.megatron.cpu_compat"
_FIX = "launcher.megatron.modelopt_fixes"

PATCHES: dict[str, Patch] = {p.name: p for p in (
    Patch("cpu_current_device", f"{_CPU}:patch_current_device",
          "Megatron allocates on torch.cuda.current_device() (RoPE inv_freq, MoE routing buffers)",
          "every rank with device=cpu", cpu_only=True),
    Patch("cpu_streams", f"{_CPU}:patch_streams",
          "the alltoall token dispatcher creates a torch.cuda.Stream in __init__",
          "every rank with device=cpu", cpu_only=True),
    Patch("cpu_alltoall_split_sizes", f"{_CPU}:patch_alltoall_split_sizes",
          "gloo's all_to_all_single needs the split sizes as lists, not CPU tensors",
          "every rank with device=cpu", cpu_only=True),
    Patch("cpu_pipeline_schedules", f"{_CPU}:patch_pipeline_schedules",
          "the forward-only pipeline schedules allocate total_num_tokens on CUDA",
          "every rank with device=cpu", cpu_only=True),
    Patch("cpu_nvfp4_dynamic_block_quant", f"{_CPU}:patch_nvfp4_dynamic_block_quant",
          "ModelOpt's NVFP4 fake quantization has CUDA kernels only; CPU tensors go through NVFP4QTensor",
          "every rank with device=cpu", cpu_only=True),
    Patch("cpu_tied_embeddings_pp", f"{_CPU}:patch_tied_embeddings_pp",
          "tied embeddings at PP>1 are copied with weight.data.cuda() in GPTModel.__init__",
          "every rank with device=cpu", cpu_only=True),
    Patch("cpu_mamba_reference_kernels", f"{_CPU}:patch_mamba_reference_kernels",
          "mamba_ssm's triton kernels have no CPU backend; CPU tensors use its pure-torch references",
          "every rank with device=cpu where Megatron can import mamba_ssm", cpu_only=True),
    Patch("modelopt_fp8_export_single_rounding", f"{_FIX}:fp8_export_single_rounding",
          "ModelOpt 0.47's exporter rounds bf16 FP8 weights twice (bf16, then FP8)",
          "before every HF import/export and every exported-weight computation"),
    Patch("modelopt_nemotron_h_embedding_name", f"{_FIX}:nemotron_h_embedding_name",
          "ModelOpt 0.47's Nemotron-H importer knows backbone.embeddings.weight only",
          "before every HF import/export"),
    Patch("modelopt_nvfp4_fast_cast", f"{_FIX}:nvfp4_fast_cast",
          "ModelOpt 0.47 packs NVFP4 weights on the host with a bucket search: 87 of a Nano-width export's 99 s",
          "before every HF import/export and every exported-weight computation"),
    Patch("modelopt_export_pack_on_gpu", f"{_FIX}:export_pack_on_gpu",
          "ModelOpt 0.47's Megatron exporter packs every weight on the host: 35 M parameters/s at Nano width",
          "before every HF import/export on a rank that sees CUDA (a CPU rank: not applied)"),
    Patch("modelopt_te_gated_mlp_extra_state", f"{_FIX}:te_gated_mlp_extra_state",
          "ModelOpt 0.47's importer drops a TE expert fc1's _extra_state: a strict load fails (TE spec)",
          "before every HF import/export (a module without extra state loads as before)"),
    Patch("moe_skip_identity_chunk_sort", "launcher.megatron.grouped_experts:install_skip_identity_chunk_sort",
          "the alltoall dispatcher sorts token chunks by an identity permutation at EP*TP=1 (a copy per layer)",
          "when the MMLU gate groups MoE experts"),
    Patch("mamba_ssm_stub", "launcher.megatron.mamba_ssm_compat:install_stub",
          "mamba_ssm without its CUDA extension fails at import (it imports selective_scan_cuda)",
          "ranks that build a hybrid (Mamba) model, before megatron.core.ssm is first imported"),
)}

_MISSING = object()


class Recorder:
    """Applies a patch's changes and remembers what they replaced."""

    def __init__(self) -> None:
        self._saved: list[tuple[Any, str, Any, bool]] = []   # (target, key, original, is_item)

    def set(self, obj: Any, attr: str, value: Any) -> None:
        own = vars(obj) if hasattr(obj, "__dict__") else {}
        self._saved.append((obj, attr, own.get(attr, _MISSING), False))
        setattr(obj, attr, value)

    def set_item(self, mapping: dict, key: str, value: Any) -> None:
        self._saved.append((mapping, key, mapping.get(key, _MISSING), True))
        mapping[key] = value

    def restore(self) -> None:
        for target, key, original, is_item in reversed(self._saved):
            if original is _MISSING:
                (target.pop(key, None) if is_item else _delattr(target, key))
            elif is_item:
                target[key] = original
            else:
                setattr(target, key, original)
        self._saved.clear()


def _delattr(obj: Any, attr: str) -> None:
    try:
        delattr(obj, attr)
    except AttributeError:
        pass


_APPLIED: dict[str, Recorder] = {}
_EVER: list[str] = []     # every patch applied in this process, in order (what a stage records)


def _installer(patch: Patch) -> Callable[[Recorder], Any]:
    module, _, func = patch.target.partition(":")
    return getattr(importlib.import_module(module), func)


def _cuda_visible() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def apply(name: str) -> bool:
    """Apply the patch ``name`` once; True when it is applied (now or before), False when it has
    nothing to do in this process."""
    if name not in PATCHES:
        raise KeyError(f"unknown patch {name!r}; registered: {sorted(PATCHES)}")
    if name in _APPLIED:
        return True
    patch = PATCHES[name]
    if patch.cpu_only and _cuda_visible():
        raise PatchRefused(
            f"patch {name} is for CPU ranks only ({patch.reason}) but this process can see a CUDA "
            f"device; CPU ranks must be started with CUDA_VISIBLE_DEVICES= (executor.device=cpu does that)")
    rec = Recorder()
    try:
        done = _installer(patch)(rec)
    except BaseException:
        rec.restore()
        raise
    if done is False:
        rec.restore()
        return False
    _APPLIED[name] = rec
    if name not in _EVER:
        _EVER.append(name)
    return True


def apply_all(names) -> list[str]:
    """Apply each of ``names`` (in order); returns the ones applied."""
    return [n for n in names if apply(n)]


def undo(name: str) -> bool:
    """Put back what ``name`` replaced; False when it was not applied."""
    rec = _APPLIED.pop(name, None)
    if rec is None:
        return False
    rec.restore()
    return True


def undo_all() -> list[str]:
    names = list(_APPLIED)
    for name in reversed(names):
        undo(name)
    return names


def applied() -> list[str]:
    """Names of the patches in force in this process, in the order they were applied."""
    return list(_APPLIED)


def applied_in_process() -> list[str]:
    """Every patch applied in this process so far, undone ones included (a stage's manifest)."""
    return list(_EVER)


def forget_applied_in_process() -> None:
    """Undo every patch in force and forget the record ``applied_in_process`` keeps: the state of a
    process that never applied one (a pooled test rank between jobs, launcher_testing.rank_pool)."""
    undo_all()
    _EVER.clear()


def cpu_patches() -> list[str]:
    return [p.name for p in PATCHES.values() if p.cpu_only]


def describe() -> list[dict]:
    """The register as records (for docs and the manifest's readers)."""
    return [{"name": p.name, "reason": p.reason, "condition": p.condition, "cpu_only": p.cpu_only,
             "applied": p.name in _APPLIED} for p in PATCHES.values()]
