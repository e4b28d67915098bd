"""Faster kernels for evaluation-only GPT models (``build_model(..., eval_kernels=True)``).

Megatron-Core's local layer spec (used where TransformerEngine is not installed) computes core
attention unfused: repeat K/V per query group, a baddbmm into an [b*heads, s, s] buffer, a
masked softmax in fp32 and a bmm.  ``SdpaCoreAttention`` replaces it with
``torch.nn.functional.scaled_dot_product_attention`` (flash attention on Hopper for bf16):
no s x s scores in memory, one kernel.  Same inputs and outputs as ``DotProductAttention``
([s, b, heads, dim] q/k/v -> [s, b, heads * dim]); causal masks only - which is what every
forward of this launcher uses (``forward_logits``: right-padded prompts under a causal mask,
so real positions never attend to padding).

The cuDNN SDPA backend is excluded (flash, memory-efficient or math kernels only).  On the H200
(torch 2.11) PyTorch picked cuDNN's fused attention, and every configuration's first pass over
new batch shapes cost ~35-45 ms per shape more than a second pass over the same shapes
(``benchmarks/mmlu_gpu.py``, dense: 1.31 s vs 0.85 s for 14 new shapes), while the local spec
showed no such gap (1.29 vs 1.28 s).  cuDNN builds an execution plan per new shape, the likely
cause; the gate sees each batch shape once.  The figures are with cuDNN's kernel: none were taken
with it excluded.

``gpt_eval_spec(spec)`` returns the layer spec with ``DotProductAttention`` swapped for it; the
model builder also sets ``bias_activation_fusion`` (Megatron's own fused SwiGLU, a
``torch.compile``'d kernel).  Both change the arithmetic a little (bf16 flash attention instead of
fp32 softmax; SwiGLU rounded once), so they are opt-in: the MMLU gate uses them on CUDA, while
quantization, export and the CPU tests use the reference local spec.  Neither has parameters
or quantizers: checkpoints and ModelOpt state are the same with or without them.
"""
from __future__ import annotations

import copy
import dataclasses

from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec


def _backends():
    from torch.nn.attention import SDPBackend

    return [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


_BACKENDS = _backends()


class SdpaCoreAttention(MegatronModule):
    """Causal scaled-dot-product attention with DotProductAttention's interface (TP, GQA)."""

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout=None, softmax_scale=None, cp_comm_type=None, pg_collection=None):
        super().__init__(config=config)
        import math

        from megatron.core.process_groups_config import ProcessGroupCollection

        if config.context_parallel_size != 1:
            raise ValueError("SdpaCoreAttention does not support context parallelism")
        if attn_mask_type not in (AttnMaskType.causal, AttnMaskType.padding_causal):
            raise ValueError(f"SdpaCoreAttention computes causal attention only, not {attn_mask_type}")
        if getattr(config, "softmax_type", "vanilla") != "vanilla" or getattr(config, "window_size", None):
            raise ValueError("SdpaCoreAttention supports vanilla softmax over the full causal window only")
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        tp = pg_collection.tp.size()
        self.heads = config.num_attention_heads // tp
        self.groups = config.num_query_groups // tp
        self.head_dim = config.kv_channels
        scale = 1.0 / math.sqrt(self.head_dim) if softmax_scale is None else softmax_scale
        if config.apply_query_key_layer_scaling:
            raise ValueError("SdpaCoreAttention does not implement apply_query_key_layer_scaling")
        self.softmax_scale = scale

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        import torch.nn.functional as F

        if attention_bias is not None or packed_seq_params is not None:
            raise ValueError("SdpaCoreAttention: no attention bias or packed sequences")
        s, b = query.shape[0], query.shape[1]
        q = query.permute(1, 2, 0, 3)                       # [b, heads, s, d]
        k = key.permute(1, 2, 0, 3)
        v = value.permute(1, 2, 0, 3)
        if self.heads != self.groups:
            rep = self.heads // self.groups
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        from torch.nn.attention import sdpa_kernel

        with sdpa_kernel(_BACKENDS):   # not cuDNN: its per-shape plan build costs ~40 ms a shape
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale)
        return out.permute(2, 0, 1, 3).reshape(s, b, self.heads * self.head_dim)


def _swap(node):
    if node is DotProductAttention:
        return SdpaCoreAttention
    if isinstance(node, ModuleSpec):
        node.module = _swap(node.module)
        node.submodules = _swap(node.submodules)
        return node
    if isinstance(node, list):
        return [_swap(x) for x in node]
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        for f in dataclasses.fields(node):
            setattr(node, f.name, _swap(getattr(node, f.name)))
    return node


def gpt_eval_spec(spec):
    """A copy of a GPT layer/block spec with every DotProductAttention replaced by SdpaCoreAttention."""
    return _swap(copy.deepcopy(spec))
