"""Model construction, the CPU training loop and MMLU-style scoring for the tiny model.

Scoring is what the pipeline's MMLU stage does: one forward over the prompt that ends at
"Answer:", argmax over the logits of " A", " B", " C", " D" at the last position.
"""
from __future__ import annotations

import math
import random
import sys
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from launcher_testing.tiny.synthetic_mmlu import LETTERS, TaskGenerator, format_prompt
from launcher_testing.tiny.tokenizer import answer_token_ids


FAMILIES = ("qwen3_moe", "nemotron_h")


@dataclass(frozen=True)
class Recipe:
    """Everything that determines the built model; its hash names the cached build."""

    family: str = "qwen3_moe"   # qwen3_moe | nemotron_h (the HF architecture trained)
    seed: int = 1234
    # task
    n_test: int = 320
    n_dev_per_subject: int = 5
    n_invented: int = 32
    n_calib: int = 256
    tokenizer_corpus_prompts: int = 600
    tokenizer_vocab: int = 1024
    # model (Qwen3-MoE)
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    num_experts: int = 8
    top_k: int = 2
    moe_intermediate_size: int = 128
    max_position_embeddings: int = 2048
    vocab_multiple: int = 128
    # nemotron_h only: layer pattern (M Mamba-2, E MoE, * attention, - MLP) and Mamba shape
    hybrid_pattern: str = "MEM*EMEM"
    mamba_num_heads: int = 8
    mamba_head_dim: int = 32
    mamba_groups: int = 2
    ssm_state_size: int = 16
    mamba_chunk_size: int = 128         # Nano's; >= every gate prompt here (see _nemotron_h_config)
    shared_expert_intermediate_size: int = 256
    routed_scaling_factor: float = 1.0
    # training
    steps: int = 800
    batch_size: int = 16
    lr: float = 7e-4      # 2e-3 and up sit on the ln(4) plateau for 1500+ steps
    warmup: int = 30
    weight_decay: float = 0.01
    max_shots: int = 5
    few_shot_fraction: float = 0.0   # > 0 lengthens the plateau past the step budget
    router_aux_loss_coef: float = 0.01
    lm_loss_weight: float = 1.0     # next-token loss on every other token (teaches the facts)
    threads: int = 1
    min_accuracy: float = 0.9

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"family={self.family!r} is not valid; valid values: {list(FAMILIES)}")
        if self.family == "nemotron_h":
            if set(self.hybrid_pattern) - set("ME*-") or not self.hybrid_pattern:
                raise ValueError(f"hybrid_pattern={self.hybrid_pattern!r} must be made of M, E, *, -")
            if self.num_layers != len(self.hybrid_pattern):
                raise ValueError(f"num_layers {self.num_layers} != len(hybrid_pattern) {len(self.hybrid_pattern)}")
            if self.mamba_num_heads % self.mamba_groups:
                raise ValueError(f"mamba_groups {self.mamba_groups} must divide mamba_num_heads "
                                 f"{self.mamba_num_heads}")
        if self.steps < 1 or self.batch_size < 1:
            raise ValueError(f"steps and batch_size must be >= 1, got {self.steps}, {self.batch_size}")
        if self.hidden_size != self.num_heads * self.head_dim:
            raise ValueError(f"hidden_size {self.hidden_size} != num_heads*head_dim "
                             f"{self.num_heads}*{self.head_dim}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_kv_heads {self.num_kv_heads} must divide num_heads {self.num_heads}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k must be in [1, num_experts={self.num_experts}], got {self.top_k}")
        if not 0.0 <= self.few_shot_fraction <= 1.0 or not 0.0 <= self.min_accuracy <= 1.0:
            raise ValueError("few_shot_fraction and min_accuracy must be in [0, 1]")
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")


def make_config(recipe: Recipe, tokenizer):
    vocab = math.ceil(len(tokenizer) / recipe.vocab_multiple) * recipe.vocab_multiple
    if recipe.family == "nemotron_h":
        return _nemotron_h_config(recipe, tokenizer, vocab)
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=vocab,
        hidden_size=recipe.hidden_size,
        intermediate_size=4 * recipe.hidden_size,   # unused: every layer is sparse
        num_hidden_layers=recipe.num_layers,
        num_attention_heads=recipe.num_heads,
        num_key_value_heads=recipe.num_kv_heads,
        head_dim=recipe.head_dim,
        num_experts=recipe.num_experts,
        num_experts_per_tok=recipe.top_k,
        moe_intermediate_size=recipe.moe_intermediate_size,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_position_embeddings=recipe.max_position_embeddings,
        tie_word_embeddings=False,
        router_aux_loss_coef=recipe.router_aux_loss_coef,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )


def _nemotron_h_config(recipe: Recipe, tokenizer, vocab: int):
    """Nano-shaped: Mamba-2 with groups, MoE with a shared relu2 expert and sigmoid routing,
    attention without positional encoding.  ``mamba_chunk_size`` is longer than every prompt
    scored with transformers here: transformers 5.14's CPU Mamba path is only right within one
    chunk (tests/test_nemotron_h_model.py); Megatron's and training's (_MambaReferenceScan)
    are right for any chunking."""
    from transformers import NemotronHConfig

    return NemotronHConfig(
        vocab_size=vocab,
        hidden_size=recipe.hidden_size,
        hybrid_override_pattern=recipe.hybrid_pattern,
        num_attention_heads=recipe.num_heads,
        num_key_value_heads=recipe.num_kv_heads,
        head_dim=recipe.head_dim,
        intermediate_size=4 * recipe.hidden_size,      # dense MLP layers ("-"), if any
        mamba_num_heads=recipe.mamba_num_heads,
        mamba_head_dim=recipe.mamba_head_dim,
        n_groups=recipe.mamba_groups,
        ssm_state_size=recipe.ssm_state_size,
        conv_kernel=4,
        chunk_size=recipe.mamba_chunk_size,
        n_routed_experts=recipe.num_experts,
        num_experts_per_tok=recipe.top_k,
        moe_intermediate_size=recipe.moe_intermediate_size,
        moe_shared_expert_intermediate_size=recipe.shared_expert_intermediate_size,
        routed_scaling_factor=recipe.routed_scaling_factor,
        n_group=1,
        topk_group=1,
        norm_topk_prob=True,
        mlp_hidden_act="relu2",
        max_position_embeddings=recipe.max_position_embeddings,
        layer_norm_epsilon=1e-5,
        tie_word_embeddings=False,
        use_cache=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )


def model_class(recipe: Recipe):
    import transformers

    return {"qwen3_moe": transformers.Qwen3MoeForCausalLM,
            "nemotron_h": transformers.NemotronHForCausalLM}[recipe.family]


class _MambaReferenceScan:
    """Runs transformers' Nemotron-H Mamba mixers through mamba_ssm's minimal SSD
    (``modules.ssd_minimal.ssd_minimal_discrete``, the Mamba-2 paper's listing: exact for any
    chunking, stable under autograd - its segment sums are masked to -inf before exp - and ~10x
    cheaper on CPU than transformers' naive path, which materializes [batch, chunk, l, s, heads,
    head_dim]).  Same computation as transformers' kernel path and Megatron's mixer: conv, SiLU,
    scan with softplus(dt + dt_bias) and no dt clamp, gated RMSNorm.  Installed on the mixer
    instances while training and scoring only; the saved model is plain transformers."""

    def __init__(self, model):
        import types

        from launcher.megatron import patches

        patches.apply("mamba_ssm_stub")   # mamba_ssm importable without its CUDA extension

        self.mixers = [m for m in model.modules() if type(m).__name__ == "NemotronHMamba2Mixer"]
        for m in self.mixers:
            m.forward = types.MethodType(_mamba_reference_forward, m)

    def remove(self):
        for m in self.mixers:
            del m.forward


def _mamba_reference_forward(mixer, hidden_states, cache_params=None, attention_mask=None, **_unused):
    import torch.nn.functional as F
    from mamba_ssm.modules.ssd_minimal import ssd_minimal_discrete
    from mamba_ssm.ops.triton.layernorm_gated import rms_norm_ref

    assert cache_params is None, "the reference forward keeps no cache (use_cache=False)"
    batch, length, _ = hidden_states.shape
    heads, head_dim, groups, state = mixer.num_heads, mixer.head_dim, mixer.n_groups, mixer.ssm_state_size
    if attention_mask is not None:
        hidden_states = hidden_states * attention_mask[:, :, None].to(hidden_states.dtype)
    z, xbc, dt = mixer.in_proj(hidden_states).split(
        [mixer.intermediate_size, mixer.intermediate_size + 2 * groups * state, heads], dim=-1)
    xbc = mixer.act(mixer.conv1d(xbc.transpose(1, 2))[..., :length].transpose(1, 2))
    if attention_mask is not None:
        xbc = xbc * attention_mask[:, :, None].to(xbc.dtype)
    x, B, C = xbc.split([mixer.intermediate_size, groups * state, groups * state], dim=-1)
    x = x.reshape(batch, length, heads, head_dim).float()
    B = B.reshape(batch, length, groups, state).float().repeat_interleave(heads // groups, dim=2)
    C = C.reshape(batch, length, groups, state).float().repeat_interleave(heads // groups, dim=2)
    dt = F.softplus(dt.float() + mixer.dt_bias.float())                      # [batch, length, heads]
    A = -mixer.A_log.float().exp()
    # the SSD result does not depend on the chunking: chunks no longer than the (short) sequence
    # keep the [chunk, chunk] segment sums small (padding 42 tokens to 128 cost 9x here)
    block = min(mixer.chunk_size, -(-length // 16) * 16)
    pad = (-length) % block

    def padded(t):
        return F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad))

    y, _ = ssd_minimal_discrete(padded(x * dt[..., None]), padded(A * dt), padded(B), padded(C), block)
    y = (y[:, :length] + mixer.D.float()[:, None] * x).reshape(batch, length, mixer.intermediate_size)
    y = rms_norm_ref(y, mixer.norm.weight, None, z=z, eps=mixer.norm.variance_epsilon,
                     group_size=mixer.norm.group_size, norm_before_gate=False)
    return mixer.out_proj(y.to(hidden_states.dtype))


class _SigmoidRouterBalance:
    """Switch-style load-balancing loss for transformers' NemotronHTopkRouter (which has none):
    num_experts * sum_e(fraction of routed slots to e * mean normalized score of e), recorded
    by forward hooks on every router during one forward."""

    def __init__(self, model):
        self.terms = []
        self.handles = [m.register_forward_hook(self._hook) for m in model.modules()
                        if type(m).__name__ == "NemotronHTopkRouter"]

    def _hook(self, module, _inputs, outputs):
        import torch

        router_logits, _weights, indices = outputs
        scores = router_logits.sigmoid()
        probs = scores / scores.sum(-1, keepdim=True)
        counts = torch.zeros_like(probs).scatter_(1, indices, 1.0)
        self.terms.append(module.num_experts * (counts.mean(0) / indices.shape[1] * probs.mean(0)).sum())

    def pop(self):
        terms, self.terms = self.terms, []
        return sum(terms) / len(terms) if terms else None


def _batch(task: TaskGenerator, tokenizer, recipe: Recipe, rng: random.Random, letter_ids, colon_id: int):
    """Token ids, and (row, position, target) of every answer letter to predict."""
    import torch

    few = rng.random() < recipe.few_shot_fraction
    seqs, targets = [], []
    for b in range(recipe.batch_size):
        n_shots = rng.randint(1, recipe.max_shots) if few else 0
        text, letters = task.training_text(n_shots)
        ids = tokenizer.encode(text, add_special_tokens=False)
        # Every " X" answer token in the text is a prediction target (i shots before it).
        pos = [i - 1 for i, t in enumerate(ids) if t in letter_ids and i > 0 and ids[i - 1] == colon_id]
        if len(pos) != len(letters):
            raise RuntimeError(f"found {len(pos)} answer positions for {len(letters)} questions in {text!r}")
        seqs.append(ids)
        targets += [(b, p, ids[p + 1]) for p in pos]
    width = max(len(s) for s in seqs)
    input_ids = torch.full((len(seqs), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for b, s in enumerate(seqs):
        input_ids[b, : len(s)] = torch.tensor(s)
        mask[b, : len(s)] = 1
    return input_ids, mask, targets


def train(model, tokenizer, task: TaskGenerator, recipe: Recipe,
          log: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True)) -> list[float]:
    """AdamW with warmup + cosine decay; cross-entropy on the answer-letter positions only."""
    import torch
    import torch.nn.functional as F

    letter_ids = answer_token_ids(tokenizer)
    colon_id = tokenizer.encode("Answer:", add_special_tokens=False)[-1]
    rng = random.Random(f"batches-{recipe.seed}")
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "norm" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "norm" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": recipe.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=recipe.lr, betas=(0.9, 0.98), eps=1e-8)

    def lr_at(step: int) -> float:
        if step < recipe.warmup:
            return recipe.lr * (step + 1) / recipe.warmup
        t = (step - recipe.warmup) / max(1, recipe.steps - recipe.warmup)
        return recipe.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * t)))

    balance = _SigmoidRouterBalance(model) if recipe.family == "nemotron_h" else None
    scan = _MambaReferenceScan(model) if recipe.family == "nemotron_h" else None
    extra = {} if balance else {"output_router_logits": recipe.router_aux_loss_coef > 0}
    model.train()
    losses: list[float] = []
    start = time.perf_counter()
    every = max(1, recipe.steps // 20)
    for step in range(recipe.steps):
        input_ids, mask, targets = _batch(task, tokenizer, recipe, rng, letter_ids, colon_id)
        out = model(input_ids=input_ids, attention_mask=mask, **extra)
        rows = torch.tensor([t[0] for t in targets])
        pos = torch.tensor([t[1] for t in targets])
        tgt = torch.tensor([t[2] for t in targets])
        loss = F.cross_entropy(out.logits[rows, pos], tgt)
        total = loss
        if recipe.lm_loss_weight > 0:
            labels = input_ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
            lm = F.cross_entropy(out.logits[:, :-1].reshape(-1, out.logits.shape[-1]), labels.reshape(-1))
            total = total + recipe.lm_loss_weight * lm
        aux = balance.pop() if balance else out.aux_loss
        total = total + (recipe.router_aux_loss_coef * aux if aux is not None else 0.0)
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        opt.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if step % every == 0 or step == recipe.steps - 1:
            recent = losses[-every:]
            log(f"[tiny] step {step + 1:4d}/{recipe.steps}  loss {sum(recent) / len(recent):.4f}  "
                f"lr {lr_at(step):.2e}  elapsed {time.perf_counter() - start:6.1f}s")
    model.eval()
    for handle in (balance.handles if balance else []):
        handle.remove()
    if scan:
        scan.remove()
    return losses


def score(model, tokenizer, rows: Sequence[dict], shots_by_subject: dict[str, list[dict]] | None = None,
          n_shots: int = 0) -> tuple[float, list[int]]:
    """MMLU accuracy: argmax of the " A".." D" logits after "Answer:"; returns (accuracy, predictions).

    Prompts of equal token length are batched together (no padding), so the result does not
    depend on batching.
    """
    import torch

    if not rows:
        raise ValueError("score() needs at least one question")
    letter_ids = torch.tensor(answer_token_ids(tokenizer))
    prompts = []
    for r in rows:
        shots = (shots_by_subject or {}).get(r["subject"], [])[:n_shots]
        if len(shots) < n_shots:
            raise ValueError(f"subject {r['subject']!r} has {len(shots)} dev examples, {n_shots} shots asked")
        prompts.append(tokenizer.encode(format_prompt(r, shots), add_special_tokens=False))
    by_len: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        by_len.setdefault(len(p), []).append(i)
    preds = [0] * len(rows)
    model.eval()
    scan = _MambaReferenceScan(model) if type(model).__name__ == "NemotronHForCausalLM" else None
    with torch.no_grad():
        for _, idx in sorted(by_len.items()):
            for k in range(0, len(idx), 64):
                chunk = idx[k: k + 64]
                logits = model(input_ids=torch.tensor([prompts[i] for i in chunk]), use_cache=False).logits[:, -1, :]
                for i, p in zip(chunk, logits[:, letter_ids].argmax(-1).tolist()):
                    preds[i] = p
    if scan:
        scan.remove()
    correct = sum(int(p == r["answer"]) for p, r in zip(preds, rows))
    return correct / len(rows), preds


__all__ = ["FAMILIES", "Recipe", "make_config", "model_class", "train", "score", "LETTERS"]
