"""Small HF checkpoints with random weights, for tests and benchmarks (written with transformers).

* ``write_byte_tokenizer`` - a byte-level BPE tokenizer without merges (``TINY_VOCAB`` tokens).
* ``write_qwen3_moe_weights`` - a random Qwen3-MoE (config.json + fp32 safetensors, no tokenizer)
  of any shape; ``write_tiny_qwen3_moe`` is the tests' one with the byte tokenizer.
* ``write_tiny_nemotron_h`` - a random Nemotron-H hybrid shaped like Nano, with the byte tokenizer.
* ``hf_logits`` - a checkpoint's fp32 logits through transformers, the reference for Megatron's.
"""
from __future__ import annotations

TINY_VOCAB = 264   # 256 byte-level tokens + <|endoftext|>, padded to a multiple of 8


def write_byte_tokenizer(path: str) -> None:
    """A byte-level BPE tokenizer without merges (256 byte tokens + EOS), saved with save_pretrained."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    vocab["<|endoftext|>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}")
    fast.save_pretrained(path)


def write_qwen3_moe_weights(path: str, vocab_size: int, eos_token_id: int, *, hidden: int = 64, layers: int = 4,
                            heads: int = 4, kv_heads: int = 2, head_dim: int = 32, ffn: int = 128,
                            moe_ffn: int = 64, experts: int = 8, top_k: int = 2, max_positions: int = 128,
                            seed: int = 0) -> str:
    """A random Qwen3-MoE checkpoint (config.json + fp32 safetensors; no tokenizer files): weights
    drawn from N(0, 0.08), wider than the 0.02 default init so that logits differ visibly."""
    import torch
    import transformers

    config = transformers.Qwen3MoeConfig(
        vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, head_dim=head_dim, intermediate_size=ffn, moe_intermediate_size=moe_ffn,
        num_experts=experts, num_experts_per_tok=top_k, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[], max_position_embeddings=max_positions, rms_norm_eps=1e-6, rope_theta=10000.0,
        tie_word_embeddings=False, hidden_act="silu", eos_token_id=eos_token_id, pad_token_id=eos_token_id,
        bos_token_id=None)
    torch.manual_seed(seed)
    model = transformers.Qwen3MoeForCausalLM(config).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
    model.save_pretrained(path)
    return path


def write_tiny_qwen3_moe(path: str, num_layers: int = 4, seed: int = 0) -> str:
    """A random Qwen3-MoE checkpoint: hidden 64, 4 heads (2 KV) of dim 32, 8 experts top-2, fp32,
    with the byte tokenizer."""
    write_qwen3_moe_weights(path, TINY_VOCAB, 256, layers=num_layers, seed=seed)
    write_byte_tokenizer(path)
    return path


def write_tiny_nemotron_h(path: str, pattern: str = "MEM*EMEM", seed: int = 0) -> str:
    """A random Nemotron-H checkpoint shaped like Nano (Mamba-2 with groups, MoE with a shared
    relu2 expert and sigmoid routing, attention without positions): hidden 64, Mamba 8 heads of
    16 in 2 groups (state 16), attention 4 heads (2 KV) of 16, 8 experts top-2, fp32."""
    import torch
    import transformers

    config = transformers.NemotronHConfig(
        vocab_size=TINY_VOCAB, hidden_size=64, hybrid_override_pattern=pattern,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96,
        mamba_num_heads=8, mamba_head_dim=16, n_groups=2, ssm_state_size=16, conv_kernel=4,
        chunk_size=8, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=48, routed_scaling_factor=2.5, max_position_embeddings=128,
        # transformers' CPU (naive) Mamba path clamps dt at time_step_min; its CUDA-kernel path,
        # mamba_ssm and Megatron do not (dt_limit (0, inf)).  A tiny minimum keeps the clamp inert.
        time_step_min=1e-6, time_step_floor=1e-6, layer_norm_epsilon=1e-5, tie_word_embeddings=False, eos_token_id=256, pad_token_id=256,
        bos_token_id=None)
    torch.manual_seed(seed)
    model = transformers.NemotronHForCausalLM(config).float().eval()
    with torch.no_grad():  # larger than the default init; a nonzero expert bias that matters
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.linspace(-0.05, 0.05, b.numel()))
    model.save_pretrained(path)
    write_byte_tokenizer(path)
    return path


def hf_logits(path: str, tokens, **config_overrides) -> "object":
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, **config_overrides).eval()
    with torch.no_grad():
        return model(tokens, use_cache=False).logits
