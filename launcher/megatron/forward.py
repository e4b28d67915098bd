"""Forward passes through Megatron's pipeline schedule (PP=1 and PP>1 alike), no grad.

Every rank of a model-parallel group must call ``forward_logits`` with the same tokens shape:
the pipeline sends activations between stages and MoE layers run collectives over the EP group.

``positions`` (one index per row) asks for the logits at those positions only: the LM head then
runs on ``batch`` hidden states instead of ``batch * seq`` (GPTModel's ``output_processor``
hook; for Megatron's HybridModel, which has no such hook, a forward pre-hook on its output layer
does the same).  The MMLU gate needs only each prompt's last real token; for a 1B dense model with a
150k vocabulary the LM head is about a quarter of the forward's matmul FLOPs at every position,
and the full [b, s, V] float32 logits of one large batch are tens of GB.
"""
from __future__ import annotations

import contextlib
import inspect
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    import torch


def causal_attention_mask(seq_len: int, device=None) -> "torch.Tensor":
    """Megatron's convention: True means masked out (upper triangle)."""
    import torch

    return torch.triu(torch.ones(1, 1, seq_len, seq_len, dtype=torch.bool, device=device), diagonal=1)


def model_device(model) -> "torch.device":
    return next(model.parameters()).device


def _logits_at(positions: "torch.Tensor"):
    """A GPTModel ``output_processor``: the LM head on hidden_states[positions[b], b] only.

    Returns [b, 1, V] (batch first, as GPTModel returns logits), so the pipeline schedule and
    Float16Module's fp32 cast treat it like ordinary logits.
    """
    import torch

    def process(*, hidden_states, output_layer, output_weight, runtime_gather_output, scale_logits,
                **_unused):
        rows = torch.arange(hidden_states.shape[1], device=hidden_states.device)
        picked = hidden_states[positions.to(hidden_states.device), rows].unsqueeze(0)   # [1, b, h]
        logits, _ = output_layer(picked, weight=output_weight, runtime_gather_output=runtime_gather_output)
        return scale_logits(logits).transpose(0, 1).contiguous()

    return process


@contextlib.contextmanager
def _output_layer_at(model, positions: "torch.Tensor"):
    """For models without GPTModel's ``output_processor`` (Megatron's HybridModel): a forward
    pre-hook on the output layer that hands it hidden_states[positions[b], b] only, [1, b, h], so
    the model returns [b, 1, V] logits exactly as ``_logits_at`` makes GPTModel do."""
    import torch

    from launcher.megatron.models import unwrap_model

    inner = unwrap_model(model)
    output_layer = getattr(inner, "output_layer", None) if getattr(inner, "post_process", False) else None
    if output_layer is None:          # not the last pipeline stage: nothing to select
        yield
        return

    def pick(_module, args, kwargs):
        hidden_states = args[0]
        rows = torch.arange(hidden_states.shape[1], device=hidden_states.device)
        picked = hidden_states[positions.to(hidden_states.device), rows].unsqueeze(0)
        return (picked, *args[1:]), kwargs

    handle = output_layer.register_forward_pre_hook(pick, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


def _has_output_processor(model) -> bool:
    from launcher.megatron.models import unwrap_model

    return "output_processor" in inspect.signature(type(unwrap_model(model)).forward).parameters


def forward_logits(model, tokens: "torch.Tensor",
                   positions: "Optional[torch.Tensor]" = None) -> "torch.Tensor | None":
    """Float32 logits on the last PP stage, None elsewhere.

    tokens [b, s]; without ``positions`` the result is [b, s, V]; with ``positions`` (a length-b
    integer tensor, 0 <= positions[i] < s) it is [b, V], row i taken at position positions[i].
    """
    import torch
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if tokens.dim() != 2:
        raise ValueError(f"tokens must be [batch, seq], got shape {tuple(tokens.shape)}")
    device = model_device(model)
    tokens = tokens.to(device)
    batch, seq = tokens.shape
    kwargs = {}
    select = contextlib.nullcontext()
    if positions is not None:
        positions = torch.as_tensor(positions, dtype=torch.long)
        if positions.shape != (batch,) or int(positions.min()) < 0 or int(positions.max()) >= seq:
            raise ValueError(f"positions must be {batch} indices in [0, {seq}), got "
                             f"{positions.tolist() if positions.numel() <= 16 else tuple(positions.shape)}")
        if _has_output_processor(model):
            kwargs["output_processor"] = _logits_at(positions)
        else:
            select = _output_layer_at(model, positions)
    position_ids = torch.arange(seq, device=device).unsqueeze(0).expand(batch, seq)
    mask = causal_attention_mask(seq, device)

    def forward_step(data_iterator, step_model):
        output = step_model(next(data_iterator), position_ids, mask, **kwargs)
        return output, lambda output_tensor, non_loss_data=False: output_tensor

    with torch.no_grad(), select:
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
    logits = outputs[0].float()
    return logits[:, 0] if positions is not None else logits
