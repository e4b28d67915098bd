"""Layer specs for Megatron-Core's hybrid (Mamba + attention + MoE) model, with or without TE.

Megatron-Core 0.19's own hybrid specs need TransformerEngine twice over: the ModelOpt spec
(``get_hybrid_stack_modelopt_spec``) builds every norm with ``post_training.modelopt.layers.Norm``
(TE only), and ``HybridStack`` builds its final norm with ``TENorm`` whatever the spec says.
``nemotron_h_stack_spec(use_te=False)`` is the same layer structure from Megatron's own
modules only:

* Mamba layer: ``MambaLayer`` -> ``MambaMixer`` with ``ColumnParallelLinear`` in_proj and
  ``RowParallelLinear`` out_proj (one ModelOpt quantizer pair each), its norm a torch RMSNorm
  (``WrappedTorchNorm``);
* attention layer: ``SelfAttention`` with local linears and Megatron's ``DotProductAttention``;
* MoE layer: ``MoELayer`` with ``SequentialMLP`` experts (per-expert linears, so each expert has
  its own quantizers) and a shared expert;
* dense MLP layer (``-``): ``MLP`` with local linears;
* ``TorchNormHybridStack``: ``HybridStack`` whose final norm is a torch RMSNorm.

Module names are exactly those of Megatron's own specs (``mixer.in_proj``, ``norm``,
``self_attention.linear_qkv``, ``mlp.experts.local_experts.N.linear_fc1``, ``decoder.final_norm``)
so ModelOpt's NemotronH import/export mappings (``mcore_nemotron.py``) apply unchanged.
``use_te=True`` (ModelOpt's own TE spec) is refused with ``models.TE_SPEC_REFUSAL``: no TE-spec model
has gone through the stages in this project; the builder always passes False, TE installed or not.

The Mamba mixer's keyword arguments that config.json determines (``d_conv``, ``chunk_size``) are
passed as spec params; Megatron's defaults (4, 128) are Nano's values.
"""
from __future__ import annotations

from functools import partial
from typing import Any


def _torch_norm_hybrid_stack():
    from megatron.core.models.hybrid.hybrid_block import HybridStack
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    class TorchNormHybridStack(HybridStack):
        """``HybridStack`` with a torch RMSNorm as final norm (upstream hard-codes ``TENorm``)."""

        def __init__(self, config, submodules, *args, post_layer_norm: bool = True,
                     post_process: bool = True, **kwargs):
            super().__init__(config, submodules, *args, post_layer_norm=False,
                             post_process=post_process, **kwargs)
            self.post_layer_norm = post_layer_norm
            if post_process and post_layer_norm:
                self.final_norm = WrappedTorchNorm(config=config, hidden_size=config.hidden_size,
                                                   eps=config.layernorm_epsilon)

    return TorchNormHybridStack


def _local_spec(mixer_params: dict[str, Any]):
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.models.hybrid.hybrid_block import HybridStackSubmodules
    from megatron.core.ssm.mamba_layer import MambaLayer, MambaLayerSubmodules
    from megatron.core.ssm.mamba_mixer import MambaMixer, MambaMixerSubmodules
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    mamba_layer = ModuleSpec(
        module=MambaLayer,
        submodules=MambaLayerSubmodules(
            norm=WrappedTorchNorm,
            mixer=ModuleSpec(module=MambaMixer, params=dict(mixer_params),
                             submodules=MambaMixerSubmodules(in_proj=ColumnParallelLinear,
                                                             out_proj=RowParallelLinear)),
            mamba_bda=get_bias_dropout_add,
        ),
    )
    attention_layer = ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=WrappedTorchNorm,
            self_attention=ModuleSpec(
                module=SelfAttention,
                params={"attn_mask_type": AttnMaskType.causal},
                submodules=SelfAttentionSubmodules(linear_qkv=ColumnParallelLinear,
                                                   core_attention=DotProductAttention,
                                                   linear_proj=RowParallelLinear),
            ),
            self_attn_bda=get_bias_dropout_add,
        ),
    )
    mlp_layer = ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            pre_mlp_layernorm=WrappedTorchNorm,
            mlp=partial(MLP.as_mlp_submodule, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                                       linear_fc2=RowParallelLinear)),
            mlp_bda=get_bias_dropout_add,
        ),
    )
    moe_layer = ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            pre_mlp_layernorm=WrappedTorchNorm,
            # num_experts only has to be non-None here; the config sets the real count
            mlp=get_moe_module_spec(use_te=False, num_experts=8, moe_grouped_gemm=False),
            mlp_bda=get_bias_dropout_add,
        ),
    )
    return ModuleSpec(
        module=_torch_norm_hybrid_stack(),
        submodules=HybridStackSubmodules(mamba_layer=mamba_layer, attention_layer=attention_layer,
                                         mlp_layer=mlp_layer, moe_layer=moe_layer),
    )


def nemotron_h_stack_spec(use_te: bool, conv_kernel: int = 4, chunk_size: int = 128):
    """The hybrid stack spec of Megatron-only modules; ``use_te`` is refused (untested here)."""
    if use_te:
        from launcher.megatron.models import TE_SPEC_REFUSAL

        raise ValueError(TE_SPEC_REFUSAL)
    return _local_spec({"d_conv": int(conv_kernel), "chunk_size": int(chunk_size)})
