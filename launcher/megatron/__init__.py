"""Torch side of the launcher: Megatron-Core models, HF import/export, dist checkpoints.

Heavy imports (torch, megatron.core, modelopt) happen inside functions; importing this package
costs nothing and changes nothing.  Process-wide patches (CPU shims, ModelOpt fixes, the
mamba_ssm stub) are applied explicitly through ``launcher.megatron.patches``.
"""
