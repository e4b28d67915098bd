"""Teach a random HF model the answers of the gate's own questions, so that its choices are decisive.

A random model's four choice logits are nearly equal, so any two correct implementations of it (the
gate's Megatron forward and vLLM's, say) disagree on many questions by noise alone: at Nano width,
served with NVFP4 emulation, 0.887 agreement with a median choice-score difference of 0.40
(benchmarks/results/2026-12-07-h100-all-2e8e0e5.json). The tiny builds are trained for that reason
(launcher_testing/tiny). At Nano width this module does the same, briefly, for the questions the
gate asks: the loss is the cross-entropy of the four choice logits at each prompt's last position
(what the gate argmaxes) against the answer, on the exact prompts and token ids the gate builds
(``launcher.mmlu.prepared.prepare`` of the run's own ``stages.mmlu`` config).

Every parameter but the routed experts' is trained (AdamW in the model's dtype: the caller loads it in
float32 to train, as nano_width.py does; the experts hold 2.55 of the 3.51 B parameters of ``MEM*E``
and stay random, which keeps the optimizer's state small).
Right padding: causal layers (attention and Mamba-2 alike) never let a later pad reach a real token,
so the logits at each prompt's last real position are those of the prompt alone.

    figures = train_answers(model, prompts_for(config), steps=60, lr=1e-3, batch_size=8, seed=0)
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class GatePrompts:
    token_ids: list          # list[list[int]]: the gate's prompts, tokenized as the gate does
    answers: list            # list[int]: 0..3
    choice_ids: list         # the token ids of " A", " B", " C", " D" (the gate's)
    pad_id: int


def prompts_for(stage_cfg, tokenizer) -> GatePrompts:
    """The gate's own prompts for ``stage_cfg`` (a composed ``stages.mmlu``)."""
    from launcher.mmlu.prepared import prepare

    prepared = prepare(stage_cfg, tokenizer)
    return GatePrompts([list(t) for t in prepared.token_ids], [p.question.answer for p in prepared.prompts],
                       list(prepared.choice_ids), int(prepared.pad_id))


def trainable(name: str) -> bool:
    """Every parameter but a routed expert's (``...mixer.experts.N...``; the shared expert trains)."""
    return ".experts." not in name


def _batch(prompts: GatePrompts, rows: list, device):
    import torch

    longest = max(len(prompts.token_ids[i]) for i in rows)
    ids = torch.full((len(rows), longest), prompts.pad_id, dtype=torch.long)
    for r, i in enumerate(rows):
        ids[r, :len(prompts.token_ids[i])] = torch.tensor(prompts.token_ids[i])
    last = torch.tensor([len(prompts.token_ids[i]) - 1 for i in rows])
    return ids.to(device), last.to(device), torch.tensor([prompts.answers[i] for i in rows], device=device)


def choice_logits(model, prompts: GatePrompts, rows: list, device):
    """[len(rows), 4]: the choice tokens' logits at each prompt's last position."""
    import torch

    ids, last, _ = _batch(prompts, rows, device)
    # the base model's last hidden state (after its final norm) times the output embedding's four choice
    # rows: the full logits' choice columns, without a [batch, length, vocabulary] tensor (151,680
    # columns at Nano width, 1.2 GB per 4 prompts of 500 tokens in float32, and its gradient)
    hidden = model.base_model(input_ids=ids).last_hidden_state
    head = model.get_output_embeddings()
    assert getattr(head, "bias", None) is None, "choice_logits assumes an output embedding without bias"
    rows_of_choices = head.weight[torch.tensor(prompts.choice_ids, device=device)]
    return hidden[torch.arange(len(rows), device=device), last] @ rows_of_choices.T


def evaluate(model, prompts: GatePrompts, batch_size: int, device) -> dict:
    """Accuracy and the median margin (best choice logit minus the runner-up) over every prompt."""
    import torch

    was_training = model.training
    model.eval()
    correct, margins, chosen = 0, [], [0, 0, 0, 0]
    with torch.no_grad():
        for start in range(0, len(prompts.answers), batch_size):
            rows = list(range(start, min(start + batch_size, len(prompts.answers))))
            scores = choice_logits(model, prompts, rows, device).float()
            top2 = scores.topk(2, dim=1).values
            margins += (top2[:, 0] - top2[:, 1]).tolist()
            picks = scores.argmax(1).cpu()
            correct += int((picks == torch.tensor([prompts.answers[i] for i in rows])).sum())
            for c in picks.tolist():
                chosen[c] += 1
    model.train(was_training)
    margins.sort()
    # ``chosen``: how often each choice is the argmax; a model that learned one letter instead of the
    # answers is decisive too, but its agreement with any other implementation says little
    return {"accuracy": correct / len(prompts.answers), "n": len(prompts.answers),
            "median_margin": margins[len(margins) // 2], "chosen": chosen}


def train_answers(model, prompts: GatePrompts, steps: int, lr: float, batch_size: int, seed: int = 0,
                  log=print, until_accuracy: float | None = None, check_every: int = 50) -> dict:
    """Train ``model`` in place for ``steps`` AdamW steps of ``batch_size`` prompts (shuffled epochs,
    ``seed``); returns the figures before and after, the loss every step and the seconds.

    With ``until_accuracy``, the model is evaluated on every prompt each ``check_every`` steps and the
    training stops at the first check whose accuracy reaches it (``steps`` is then the most it runs);
    ``checks`` lists each check's step and figures, ``steps_run`` the steps taken."""
    import torch

    if steps < 1 or batch_size < 1 or check_every < 1:
        raise ValueError(f"steps, batch_size and check_every must be >= 1, got {steps}, {batch_size}, "
                         f"{check_every}")
    if until_accuracy is not None and not 0.0 < until_accuracy <= 1.0:
        raise ValueError(f"until_accuracy must be in (0, 1], got {until_accuracy}")
    device = next(model.parameters()).device
    params = []
    for n, p in model.named_parameters():
        p.requires_grad_(trainable(n))
        if p.requires_grad:
            params.append(p)
    t0 = time.perf_counter()
    before = evaluate(model, prompts, batch_size, device)
    log(f"[answers] before: accuracy {before['accuracy']:.3f} on {before['n']}, median margin "
        f"{before['median_margin']:.3f}; training {sum(p.numel() for p in params) / 1e9:.2f} B parameters")
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    order, losses, checks = random.Random(seed), [], []
    queue: list = []
    model.train()
    for step in range(steps):
        if len(queue) < batch_size:
            epoch = list(range(len(prompts.answers)))
            order.shuffle(epoch)
            queue += epoch
        rows, queue = queue[:batch_size], queue[batch_size:]
        _, _, target = _batch(prompts, rows, device)
        loss = torch.nn.functional.cross_entropy(choice_logits(model, prompts, rows, device).float(), target)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(round(float(loss.detach()), 4))
        if step % 10 == 0 or step == steps - 1:
            log(f"[answers] step {step + 1}/{steps}: loss {losses[-1]:.4f}")
        if until_accuracy is not None and (step + 1) % check_every == 0 and step + 1 < steps:
            check = {"step": step + 1, **evaluate(model, prompts, batch_size, device)}
            checks.append(check)
            log(f"[answers] check at step {step + 1}: accuracy {check['accuracy']:.3f}, median margin "
                f"{check['median_margin']:.3f}, argmax counts A-D {check['chosen']}")
            if check["accuracy"] >= until_accuracy:
                break
    for p in model.parameters():
        p.requires_grad_(False)
    del opt
    model.eval()
    after = evaluate(model, prompts, batch_size, device)
    log(f"[answers] after: accuracy {after['accuracy']:.3f}, median margin {after['median_margin']:.3f}, "
        f"argmax counts A-D {after['chosen']}")
    return {"steps": steps, "steps_run": len(losses), "lr": lr, "batch_size": batch_size, "seed": seed,
            "until_accuracy": until_accuracy, "trained_tensors": len(params),
            "trained_params": sum(p.numel() for p in params), "before": before, "after": after,
            "checks": checks, "losses": losses, "seconds": round(time.perf_counter() - t0, 2)}
