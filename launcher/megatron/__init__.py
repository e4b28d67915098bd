"""Torch side of the launcher: Megatron-Core models, HF import/export, dist checkpoints.

Heavy imports (torch, megatron.core, modelopt) happen inside functions; importing this package
costs nothing.  CPU-only workarounds live in ``cpu_compat`` and are applied only on CPU.
"""

from launcher.megatron.mamba_ssm_compat import ensure_mamba_ssm_importable as _ensure_mamba_ssm

_ensure_mamba_ssm()   # before anything imports megatron.core.ssm (see mamba_ssm_compat)
