"""HF checkpoint config.json -> Megatron-Core model (this rank's pipeline stage, eval mode).

Every dimension comes from the checkpoint's config.json.  GPT-style architectures
(Qwen3-MoE, Qwen3, Llama) build a ``GPTModel``; Nemotron-H builds Megatron's ``HybridModel``
(Mamba-2 + attention + MoE, ``launcher.megatron.hybrid_spec``; needs mamba_ssm, not TE).  On CPU the model is fp32; on CUDA it is built in the requested dtype
and, for bf16/fp16, wrapped in Megatron's ``Float16Module`` (a bare bf16 GPTModel fails with
"mat1 and mat2 must have the same dtype").  Use ``unwrap_model`` to reach the GPTModel that
ModelOpt's import/export/quantize and dist-checkpointing operate on.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from launcher.architectures import ARCHITECTURES, Architecture, architecture
from launcher.contract import Dtype, values
from launcher.hf_config import read_hf_config

if TYPE_CHECKING:
    import torch

    from launcher.topology import ParallelDims

DTYPES = values(Dtype)   # the schema's dtype choices (launcher.contract.Dtype)


def architecture_of(hf_config: dict[str, Any]) -> Architecture:
    """The supported architecture (``launcher.architectures``) config.json names first."""
    archs = hf_config.get("architectures") or []
    if not archs:
        raise ValueError("config.json has no 'architectures' entry; cannot choose a Megatron model")
    return architecture(archs[0])


def resolve_dtype(dtype: "str | torch.dtype", device: str) -> "torch.dtype":
    """CPU always runs fp32 (no bf16 matmul kernels worth using); CUDA uses ``dtype``."""
    import torch

    name = str(dtype).replace("torch.", "")
    if name not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not valid; valid values: {list(DTYPES)}")
    return torch.float32 if device == "cpu" else getattr(torch, name)


# Why the launcher's stages never take TransformerEngine's layer specs, even where TE is installed (an
# NGC container): no TE-spec model has gone through the stages (gate, export, verification) here.  What
# was measured (an H100, 2026-12-07, README "TransformerEngine"): TE 2.20.2 built on the host
# (transformer_engine_torch is an sdist only) and imported; with ``modelopt_fixes.te_gated_mlp_extra_state``
# (ModelOpt 0.47's HF import dropped a TE expert fc1's _extra_state) the TE-spec tiny Qwen3-MoE gave the
# local spec's 320 predictions exactly, unquantized, NVFP4 and FP8 (scripts/te_trial.py).  The export
# of a TE-spec model was not tried.  Megatron's own local modules run everywhere and are tested.
TE_SPEC_REFUSAL = ("TransformerEngine layer specs are not supported by this launcher's stages: no TE-spec model "
                   "has completed the gate here (on an H100 the TE-spec tiny Qwen3-MoE gave the local spec's "
                   "predictions, unquantized, NVFP4 and FP8, in scripts/te_trial.py; its export was not tried; "
                   "README, 'TransformerEngine'); the local Megatron spec is used on every machine")
# ``build_model(layer_spec=...)``: "local" everywhere; "te" (Megatron's TransformerEngine spec, GPT
# architectures on CUDA where transformer_engine imports) only for scripts/te_trial.py, the GPU trial
# that compares it with the local spec.  No config key reaches it: the launcher's stages stay local.
LAYER_SPECS = ("local", "te")


def check_layer_spec(layer_spec: str, arch: "Architecture", device: str) -> None:
    """A ValueError unless ``layer_spec`` can build ``arch`` on ``device`` (TE imported only for "te")."""
    if layer_spec not in LAYER_SPECS:
        raise ValueError(f"layer_spec={layer_spec!r} is not valid; valid values: {list(LAYER_SPECS)}")
    if layer_spec == "local":
        return
    if arch.builder == "hybrid":
        raise ValueError(TE_SPEC_REFUSAL)
    if device != "cuda":
        raise ValueError(f"layer_spec='te' needs device='cuda' (TransformerEngine's modules run on NVIDIA "
                         f"GPUs only), not {device!r}")
    try:
        import transformer_engine.pytorch  # noqa: F401
    except ImportError as e:
        raise ValueError(f"layer_spec='te' needs TransformerEngine's PyTorch package "
                         f"(transformer_engine_torch): {type(e).__name__}: {e}") from e


def _rope(hf: dict[str, Any]) -> dict[str, Any]:
    """RoPE base and Llama-3 scaling from either the transformers 4 or 5 layout."""
    params = dict(hf.get("rope_parameters") or {})
    scaling = hf.get("rope_scaling") or {}
    params = {**scaling, **params}
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    out = {"rotary_base": theta, "rope_scaling": False}
    if rope_type == "default":
        return out
    if rope_type == "llama3":
        expected = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
        for key, value in expected.items():
            if key in params and float(params[key]) != value:
                raise ValueError(f"rope llama3 {key}={params[key]} is not supported; Megatron's llama3 "
                                 f"scaling is fixed at {expected}")
        out.update(rope_scaling=True, rope_scaling_factor=float(params.get("factor", 8.0)))
        return out
    raise ValueError(f"rope_type={rope_type!r} is not supported; supported: ['default', 'llama3']")


def _attention_kwargs(hf: dict[str, Any]) -> dict[str, Any]:
    """Hidden size and attention shape, shared by every architecture's TransformerConfig."""
    heads = hf["num_attention_heads"]
    return dict(
        hidden_size=hf["hidden_size"],
        num_attention_heads=heads,
        num_query_groups=hf.get("num_key_value_heads") or heads,
        kv_channels=hf.get("head_dim") or hf["hidden_size"] // heads,
        ffn_hidden_size=hf["intermediate_size"],
    )


def _gpt_config_kwargs(arch: str, hf: dict[str, Any]) -> dict[str, Any]:
    """TransformerConfig keyword arguments for a GPT-style HF config."""
    import torch.nn.functional as F

    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={hf.get('hidden_act')!r} is not supported; supported: ['silu']")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            raise ValueError(f"{key}=true is not supported by this launcher's model builder")
    if hf.get("use_sliding_window"):
        raise ValueError("use_sliding_window=true is not supported (Megatron GPTModel uses full attention)")
    kw = dict(
        num_layers=hf["num_hidden_layers"],
        **_attention_kwargs(hf),
        layernorm_epsilon=float(hf.get("rms_norm_eps", 1e-6)),
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        qk_layernorm=arch.startswith("Qwen3"),
    )
    if arch == "Qwen3MoeForCausalLM":
        num_layers = kw["num_layers"]
        mlp_only = set(hf.get("mlp_only_layers") or [])
        step = int(hf.get("decoder_sparse_step", 1) or 1)
        pattern = [0 if (i in mlp_only or (i + 1) % step) else 1 for i in range(num_layers)]
        num_experts = hf.get("num_experts") or hf.get("num_local_experts")  # transformers 4 / 5 name
        if not num_experts:
            raise ValueError("config.json of a Qwen3MoeForCausalLM has neither num_experts nor num_local_experts")
        kw.update(
            num_moe_experts=num_experts,
            moe_router_topk=hf["num_experts_per_tok"],
            moe_ffn_hidden_size=hf["moe_intermediate_size"],
            moe_router_score_function="softmax",
            # norm_topk_prob: softmax over the top-k (pre_softmax=False); else top-k of the softmax.
            moe_router_pre_softmax=not hf.get("norm_topk_prob", True),
            moe_layer_freq=1 if all(pattern) else pattern,
        )
    return kw


def _runtime_kwargs(device: str, dtype: "torch.dtype", dims: "ParallelDims", dispatcher: str) -> dict[str, Any]:
    import torch

    return dict(
        use_cpu_initialization=(device == "cpu"),
        perform_initialization=True,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=(dtype == torch.bfloat16),
        fp16=(dtype == torch.float16),
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=dims.tp,
        pipeline_model_parallel_size=dims.pp,
        context_parallel_size=dims.cp,
        expert_model_parallel_size=dims.ep,
        expert_tensor_parallel_size=dims.etp,
        sequence_parallel=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        moe_token_dispatcher_type=dispatcher,
        moe_grouped_gemm=False,          # per-expert linears: one weight quantizer per expert
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_permute_fusion=False,
    )


def _build_gpt(arch: str, hf: dict[str, Any], dims: "ParallelDims", device: str, dtype, dispatcher: str,
               eval_kernels: bool = False, fused_activation: bool | None = None, layer_spec: str = "local"):
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    kw = {**_runtime_kwargs(device, dtype, dims, dispatcher), **_gpt_config_kwargs(arch, hf)}
    if (eval_kernels and device == "cuda") if fused_activation is None else fused_activation:
        kw["bias_activation_fusion"] = True   # Megatron's fused (torch.compile'd) SwiGLU: eval only
    if "num_moe_experts" not in kw:
        for key in [k for k in kw if k.startswith("moe_")]:
            del kw[key]
    config = TransformerConfig(**kw)
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    # Megatron's local modules, TE installed or not (TE_SPEC_REFUSAL says why); TE's for the trial only
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=layer_spec == "te", normalization="RMSNorm")
    if eval_kernels:
        from launcher.megatron.eval_kernels import gpt_eval_spec

        spec = gpt_eval_spec(spec)   # SDPA core attention (launcher.megatron.eval_kernels)
    rope = _rope(hf)
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=hf["vocab_size"],
        max_sequence_length=hf.get("max_position_embeddings", 4096),
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        parallel_output=False,  # gather the vocab dimension: forward_logits returns full logits
        share_embeddings_and_output_weights=bool(hf.get("tie_word_embeddings", False)),
        position_embedding_type="rope",
        **rope,
    )
    return model


def _nemotron_h_config_kwargs(hf: dict[str, Any]) -> dict[str, Any]:
    """TransformerConfig keyword arguments for Nemotron-H (architecture part only).

    Every option that Megatron's hybrid model computes differently from transformers'
    ``NemotronHForCausalLM`` is refused (``hf_config.nemotron_h_unsupported``), naming the key.
    """
    import torch.nn.functional as F

    from launcher.hf_config import nemotron_h_pattern, nemotron_h_unsupported

    problems = nemotron_h_unsupported(hf)
    if problems:
        raise ValueError("; ".join(problems))
    pattern = nemotron_h_pattern(hf)

    def squared_relu(x):
        return F.relu(x) ** 2

    heads = hf.get("mamba_num_heads")
    head_dim = hf.get("mamba_head_dim", 64)
    groups = hf.get("n_groups", 8)
    kw = dict(
        num_layers=len(pattern),
        **_attention_kwargs(hf),
        layernorm_epsilon=float(hf.get("layer_norm_epsilon", 1e-5)),
        normalization="RMSNorm",
        gated_linear_unit=False,
        activation_func=squared_relu,
        add_bias_linear=False,
        is_hybrid_model=True,
        mamba_num_heads=heads,
        mamba_head_dim=head_dim,
        mamba_state_dim=hf.get("ssm_state_size", 128),
        mamba_num_groups=groups,
        # the prefill path: one scan kernel (mamba_chunk_scan_combined) + a plain conv1d, on
        # every device; the memory-efficient path fuses them for training only
        use_mamba_mem_eff_path=False,
    )
    if "E" in pattern:
        topk = hf["num_experts_per_tok"]
        n_group = hf.get("n_group") or 1
        kw.update(
            num_moe_experts=hf["n_routed_experts"],
            moe_router_topk=topk,
            moe_ffn_hidden_size=hf["moe_intermediate_size"],
            # transformers builds one shared MLP of moe_shared_expert_intermediate_size
            moe_shared_expert_intermediate_size=hf.get("moe_shared_expert_intermediate_size") or None,
            moe_router_score_function="sigmoid",
            moe_router_enable_expert_bias=True,
            moe_router_topk_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
            moe_router_pre_softmax=False,
        )
        if n_group > 1:
            kw.update(moe_router_num_groups=n_group, moe_router_group_topk=hf.get("topk_group"))
    return kw


def _build_nemotron_h(hf: dict[str, Any], dims: "ParallelDims", device: str, dtype, dispatcher: str):
    """Nemotron-H hybrid (Mamba-2 + attention + MoE): Megatron's HybridModel, no TE needed."""
    from megatron.core import parallel_state
    from megatron.core.models.hybrid.hybrid_model import HybridModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    from launcher.hf_config import nemotron_h_pattern
    from launcher.megatron.hybrid_spec import nemotron_h_stack_spec

    kw = {**_runtime_kwargs(device, dtype, dims, dispatcher), **_nemotron_h_config_kwargs(hf)}
    if "num_moe_experts" not in kw:
        for key in [k for k in kw if k.startswith("moe_")]:
            del kw[key]
    config = TransformerConfig(**kw)
    spec = nemotron_h_stack_spec(use_te=False,
                                 conv_kernel=hf.get("conv_kernel", 4), chunk_size=hf.get("chunk_size", 128))
    return HybridModel(
        config=config,
        hybrid_stack_spec=spec,
        vocab_size=hf["vocab_size"],
        max_sequence_length=hf.get("max_position_embeddings", 4096),
        hybrid_layer_pattern=nemotron_h_pattern(hf),
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        parallel_output=False,
        share_embeddings_and_output_weights=bool(hf.get("tie_word_embeddings", False)),
        position_embedding_type="none",   # Nemotron-H attention has no positional encoding
    )


def check_buildable(hf_path: str, device: str) -> str:
    """The architecture, or a ValueError when it cannot be built on ``device``."""
    arch = architecture_of(read_hf_config(hf_path))
    if arch.gpu_only and device != "cuda":
        raise ValueError(f"{arch.name} cannot be built on {device}: {arch.gpu_only}")
    if arch.hybrid:
        from launcher.megatron.mamba_ssm_compat import megatron_mamba_status

        usable, reason = megatron_mamba_status()
        if not usable:
            raise ValueError(f"{arch.name} (hybrid Mamba) cannot be built here: {reason}")
    return arch.name


def build_model(hf_path: str, dims: "ParallelDims", device: str, dtype="bfloat16",
                dispatcher: str = "alltoall", trust_remote_code: bool = False, eval_kernels: bool = False,
                fused_activation: bool | None = None, layer_spec: str = "local"):
    """This rank's pipeline stage of the Megatron model for the checkpoint at ``hf_path``.

    Call after ``launcher.megatron.dist.init_distributed``.  ``trust_remote_code`` is accepted
    for symmetry with the HF loaders; the builder reads config.json itself.  ``eval_kernels``
    (GPT architectures, local spec): SDPA core attention and, on CUDA, fused SwiGLU - for
    evaluation only, it changes the arithmetic slightly (``launcher.megatron.eval_kernels``).
    ``fused_activation`` forces Megatron's torch.compile'd SwiGLU (``bias_activation_fusion``)
    on or off for GPT architectures (default: with ``eval_kernels`` on CUDA); the CPU test of
    the compiled path uses it.  ``layer_spec``: ``LAYER_SPECS`` (``check_layer_spec``); "te" does
    not combine with ``eval_kernels`` (they replace the local spec's core attention).
    """
    arch = ARCHITECTURES[check_buildable(hf_path, device)]
    check_layer_spec(layer_spec, arch, device)
    if layer_spec == "te" and eval_kernels:
        raise ValueError("eval_kernels=True applies to layer_spec='local' only (it replaces the local "
                         "spec's core attention); build the TE spec with eval_kernels=False")
    if dispatcher not in arch.dispatchers:
        raise ValueError(f"moe_dispatcher={dispatcher!r} is not valid; valid values: {list(arch.dispatchers)}")
    torch_dtype = resolve_dtype(dtype, device)
    if str(dtype).replace("torch.", "") not in arch.dtypes:
        raise ValueError(f"dtype={dtype!r} is not valid for {arch.name}; valid values: {list(arch.dtypes)}")
    hf = read_hf_config(hf_path)
    if arch.builder == "hybrid":
        model = _build_nemotron_h(hf, dims, device, torch_dtype, dispatcher)
    else:
        model = _build_gpt(arch.name, hf, dims, device, torch_dtype, dispatcher, eval_kernels, fused_activation,
                           layer_spec)
    if device == "cuda":
        import torch

        model = model.cuda(torch.cuda.current_device())
        if model.config.bf16 or model.config.fp16:
            from megatron.core.transformer.module import Float16Module

            model = Float16Module(model.config, model)
    model.eval()
    return model


def unwrap_model(model):
    """The GPTModel / HybridModel inside Megatron wrappers (Float16Module, DDP)."""
    from megatron.core.transformer.module import Float16Module

    while isinstance(model, Float16Module) or (hasattr(model, "module") and not hasattr(model, "decoder")):
        model = model.module
    return model
