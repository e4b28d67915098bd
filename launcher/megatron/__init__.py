"""Torch side of the launcher: Megatron-Core models, HF import/export, dist checkpoints.

Heavy imports (torch, megatron.core, modelopt) happen inside functions; importing this package
costs nothing.  CPU-only workarounds live in ``cpu_compat`` and are applied only on CPU.
"""
