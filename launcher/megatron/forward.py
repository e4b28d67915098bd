"""Forward passes through Megatron's pipeline schedule (PP=1 and PP>1 alike), no grad.

Every rank of a model-parallel group must call ``forward_logits`` with the same tokens shape:
the pipeline sends activations between stages and MoE layers run collectives over the EP group.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def causal_attention_mask(seq_len: int, device=None) -> "torch.Tensor":
    """Megatron's convention: True means masked out (upper triangle)."""
    import torch

    return torch.triu(torch.ones(1, 1, seq_len, seq_len, dtype=torch.bool, device=device), diagonal=1)


def model_device(model) -> "torch.device":
    return next(model.parameters()).device


def forward_logits(model, tokens: "torch.Tensor") -> "torch.Tensor | None":
    """Logits [b, s, V] (float32) for ``tokens`` [b, s] on the last PP stage; None elsewhere."""
    import torch
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if tokens.dim() != 2:
        raise ValueError(f"tokens must be [batch, seq], got shape {tuple(tokens.shape)}")
    device = model_device(model)
    tokens = tokens.to(device)
    batch, seq = tokens.shape
    position_ids = torch.arange(seq, device=device).unsqueeze(0).expand(batch, seq)
    mask = causal_attention_mask(seq, device)

    def forward_step(data_iterator, step_model):
        output = step_model(next(data_iterator), position_ids, mask)
        return output, lambda output_tensor, non_loss_data=False: output_tensor

    with torch.no_grad():
        outputs = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter([tokens]),
            model=[model],
            num_microbatches=1,
            seq_length=seq,
            micro_batch_size=batch,
            forward_only=True,
            collect_non_loss_data=True,
        )
    if not outputs:
        return None
    return outputs[0].float()
