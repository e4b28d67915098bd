"""MMLU gate: data sources, lm-eval prompts, batching, EP-safe shard plans, desync guard, gate.

Pure Python (no torch import): ``data``, ``prompts``, ``batching``, ``sharding``, ``gate``.
Torch side: ``guard`` (gloo all-gather per step), ``evaluate`` (runs a plan on a Megatron model).
The stage itself is ``launcher.stages.mmlu``.
"""
