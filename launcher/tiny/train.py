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

from launcher.tiny.synthetic_mmlu import LETTERS, TaskGenerator, format_prompt
from launcher.tiny.tokenizer import answer_token_ids


@dataclass(frozen=True)
class Recipe:
    """Everything that determines the built model; its hash names the cached build."""

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
    from transformers import Qwen3MoeConfig

    vocab = math.ceil(len(tokenizer) / recipe.vocab_multiple) * recipe.vocab_multiple
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

    model.train()
    losses: list[float] = []
    start = time.perf_counter()
    every = max(1, recipe.steps // 20)
    for step in range(recipe.steps):
        input_ids, mask, targets = _batch(task, tokenizer, recipe, rng, letter_ids, colon_id)
        out = model(input_ids=input_ids, attention_mask=mask,
                    output_router_logits=recipe.router_aux_loss_coef > 0)
        rows = torch.tensor([t[0] for t in targets])
        pos = torch.tensor([t[1] for t in targets])
        tgt = torch.tensor([t[2] for t in targets])
        loss = F.cross_entropy(out.logits[rows, pos], tgt)
        total = loss
        if recipe.lm_loss_weight > 0:
            labels = input_ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
            lm = F.cross_entropy(out.logits[:, :-1].reshape(-1, out.logits.shape[-1]), labels.reshape(-1))
            total = total + recipe.lm_loss_weight * lm
        total = total + (recipe.router_aux_loss_coef * out.aux_loss if out.aux_loss is not None else 0.0)
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
    with torch.no_grad():
        for _, idx in sorted(by_len.items()):
            for k in range(0, len(idx), 64):
                chunk = idx[k: k + 64]
                logits = model(input_ids=torch.tensor([prompts[i] for i in chunk])).logits[:, -1, :]
                for i, p in zip(chunk, logits[:, letter_ids].argmax(-1).tolist()):
                    preds[i] = p
    correct = sum(int(p == r["answer"]) for p, r in zip(preds, rows))
    return correct / len(rows), preds


__all__ = ["Recipe", "make_config", "train", "score", "LETTERS"]
