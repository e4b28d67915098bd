"""Grouped expert computation for evaluation: two grouped GEMMs per MoE layer instead of a Python
loop over ``SequentialMLP``'s experts, with each expert's own quantization semantics.

The model keeps ``moe_grouped_gemm=False`` (one ``linear_fc1``/``linear_fc2`` per expert, each with
its own ModelOpt quantizers: what quantization, checkpoints and export need).  For the gate,
``enable_grouped_experts(model)`` gives every eligible ``SequentialMLP`` an instance ``forward``
that computes the same thing in one pass over the tokens (already sorted by expert by the token
dispatcher):

    x1 = input quantization of fc1 (per expert)     h = grouped_mm(x1, W1[e]^T)
    a  = activation(h) * probs, cast back           x2 = input quantization of fc2 (per expert)
    y  = grouped_mm(x2, W2[e]^T)

``W1``/``W2`` are the experts' weights stacked once ([E, out, in]); each expert's parameter then
becomes a view of its slice, so no memory is duplicated and a later ``load_state_dict`` writes
into the stack.  ``torch._grouped_mm`` does the matmuls (CUTLASS grouped GEMM on Hopper; a loop
of the same matmuls on CPU, where it equals the per-expert path bit for bit).

Per-expert quantization: weight quantizers must be folded first (``launcher.megatron.fold``),
so each expert's quantized weight is already in its slice of the stack.  Input quantizers:
when the experts' quantizers of a linear are equivalent (same class, configuration and state,
e.g. the shared input amax ModelOpt's calibration gives all local experts of a layer) and
quantize each row independently (a static per-tensor amax, or dynamic blocks along the last
dim), the first expert's quantizer runs once on all rows - which is what each expert's own
quantizer computes on its rows.  Otherwise each expert's quantizer runs on its own rows (a loop
of quantizer calls, but still one grouped GEMM).

Not grouped (the layer keeps the loop; ``enable_grouped_experts`` says why): an unfolded weight
quantizer, an enabled output quantizer, biases, expert tensor parallelism > 1, TE activation,
FP8/FP4 training recipes (``config.fp8``/``fp4``), or, on CUDA, a dtype other than bf16
(the grouped GEMM kernel's).  ``disable_grouped_experts`` restores the class forward and undoes
the patch below.

``enable_grouped_experts`` also applies the patch register's ``moe_skip_identity_chunk_sort``
(``launcher.megatron.patches``): at EP x TP = 1 the
alltoall dispatcher "sorts tokens by local expert" with an identity order - it splits the
tokens (and probs, and on the way back the outputs) into one chunk per expert and
concatenates them in the same order: three copies of the routed tokens per MoE layer and ~400
host-side slice ops (the H200 profile: 2.7 of 12.6 ms of kernel time of a 4-layer MoE
forward).  The wrapper returns the input unchanged when the order is the identity (the same
values; any other order goes to Megatron's function).
"""
from __future__ import annotations

from typing import Any, Optional

_ATTR = "_grouped_eval"


def _quantizers(experts, linear: str) -> list:
    return [getattr(getattr(e, linear), "input_quantizer", None) for e in experts.local_experts]


def _enabled(q) -> bool:
    return q is not None and bool(getattr(q, "is_enabled", False))


def _rowwise(q) -> bool:
    """True when ``q`` quantizes every row of a [tokens, features] input independently."""
    if getattr(q, "_num_bits", None) is None or getattr(q, "axis", None) is not None:
        return False
    if getattr(q, "rotate_is_enabled", False) or getattr(q, "amax", None) is None:
        return False
    blocks = getattr(q, "block_sizes", None)
    if blocks:
        if blocks.get("type", "static") != "dynamic":
            return False
        if [k for k in blocks if k not in (-1, "type", "scale_bits")]:
            return False
    return q.amax.numel() == 1


def _equivalent(a, b) -> bool:
    import torch

    if type(a) is not type(b) or a.extra_repr() != b.extra_repr():
        return False
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def _input_plan(experts, linear: str):
    """None (no input quantization), ("shared", q) or ("each", [q per expert])."""
    qs = _quantizers(experts, linear)
    enabled = [_enabled(q) for q in qs]
    if not any(enabled):
        return None
    if all(enabled) and all(_equivalent(qs[0], q) for q in qs[1:]) and _rowwise(qs[0]):
        return ("shared", qs[0])
    return ("each", qs)


def _ineligible(experts) -> Optional[str]:
    import torch

    cfg = experts.config
    if experts.num_local_experts < 2:
        return "a single local expert"
    if cfg.add_bias_linear:
        return "expert linears have biases"
    if cfg.fp8 or getattr(cfg, "fp4", None):
        return "config.fp8/fp4 (TE training recipes) pad tokens per expert"
    if cfg.use_te_activation_func:
        return "TE activation function"
    if experts.tp_group is not None and experts.tp_group.size() > 1:
        return f"expert tensor parallel size {experts.tp_group.size()} > 1"
    w = experts.local_experts[0].linear_fc1.weight
    if w.is_cuda and w.dtype != torch.bfloat16:
        return f"dtype {w.dtype} on CUDA (the grouped GEMM kernel takes bf16)"
    for e in experts.local_experts:
        for linear in (e.linear_fc1, e.linear_fc2):
            if _enabled(getattr(linear, "weight_quantizer", None)):
                return "weight quantizers are not folded (launcher.megatron.fold first)"
            if _enabled(getattr(linear, "output_quantizer", None)):
                return "an output quantizer is enabled"
            if getattr(linear, "bias", None) is not None:
                return "expert linears have biases"
    return None


def _stack(params: list) -> "Any":
    """One [E, out, in] tensor holding the weights; each parameter becomes a view of its slice."""
    import torch

    with torch.no_grad():
        stacked = torch.stack([p.detach() for p in params])
        for i, p in enumerate(params):
            p.data = stacked[i]
    return stacked


class GroupedExpertsForward:
    """The instance ``forward`` of one ``SequentialMLP`` (same signature and outputs)."""

    def __init__(self, experts):
        self.experts = experts
        self.config = experts.config
        self.w1 = _stack([e.linear_fc1.weight for e in experts.local_experts])   # [E, f1, h]
        self.w2 = _stack([e.linear_fc2.weight for e in experts.local_experts])   # [E, h, f]
        self.q1 = _input_plan(experts, "linear_fc1")
        self.q2 = _input_plan(experts, "linear_fc2")

    def _quantize(self, x, plan, counts: list[int]):
        import torch

        if plan is None:
            return x
        kind, q = plan
        if kind == "shared":
            return q(x)
        parts = torch.split(x, counts)
        return torch.cat([qe(part) if part.shape[0] else part for qe, part in zip(q, parts)], dim=0)

    def _activation(self, h, probs):
        import torch

        cfg = self.config
        if cfg.bias_activation_fusion:
            from megatron.core.fusions.fused_bias_swiglu import weighted_bias_swiglu_impl

            if not (cfg.gated_linear_unit and cfg.activation_func is torch.nn.functional.silu):
                raise AssertionError("bias_activation_fusion without SwiGLU is rejected by MLP")
            return weighted_bias_swiglu_impl(h, None, probs.unsqueeze(-1), cfg.activation_func_fp8_input_store)
        if cfg.gated_linear_unit:
            x_glu, x_linear = torch.chunk(h, 2, dim=-1)
            if (val := cfg.activation_func_clamp_value) is not None:
                x_glu = x_glu.clamp(min=None, max=val)
                x_linear = x_linear.clamp(min=-val, max=val)
            a = cfg.activation_func(x_glu) * (x_linear + cfg.glu_linear_offset)
        else:
            a = cfg.activation_func(h)
        return (a * probs.unsqueeze(-1)).to(a.dtype)

    def __call__(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
        import torch

        x, probs = permuted_local_hidden_states, permuted_probs
        if self.config.moe_apply_probs_on_input:
            x = (probs.unsqueeze(-1) * x).to(x.dtype)
            probs = torch.ones_like(probs)
        counts = [int(c) for c in tokens_per_expert.tolist()]
        if x.shape[0] == 0:
            return x.new_zeros((0, self.w2.shape[1])), None
        offs = torch.tensor(counts, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(x.device)
        h = torch._grouped_mm(self._quantize(x, self.q1, counts), self.w1.transpose(1, 2), offs=offs)
        a = self._activation(h, probs)
        out = torch._grouped_mm(self._quantize(a, self.q2, counts), self.w2.transpose(1, 2), offs=offs)
        return out, None


def install_skip_identity_chunk_sort(rec) -> None:
    """The patch register's ``moe_skip_identity_chunk_sort``: wrap the token dispatcher's
    ``sort_chunks_by_idxs`` to return its input when the index is the identity."""
    import megatron.core.transformer.moe.token_dispatcher as td

    original = td.sort_chunks_by_idxs
    identity: dict = {}   # the dispatcher's fixed CUDA index tensors -> is it the identity (dropped on undo)

    def is_identity(idx) -> bool:
        import torch

        if not idx.is_cuda:   # a CPU index (Megatron's default): check it every call, no sync
            return bool(torch.equal(idx, torch.arange(idx.numel(), dtype=idx.dtype)))
        key = (idx.data_ptr(), idx.numel(), str(idx.device))   # the dispatcher's fixed index tensors
        if key not in identity:
            identity[key] = bool(torch.equal(idx.cpu(), torch.arange(idx.numel(), dtype=idx.dtype)))
        return identity[key]

    def sort_chunks(input, split_sizes, sorted_idxs, probs=None, fused=False):
        if is_identity(sorted_idxs):
            return input, probs
        return original(input, split_sizes, sorted_idxs, probs=probs, fused=fused)

    sort_chunks._skips_identity = True
    rec.set(td, "sort_chunks_by_idxs", sort_chunks)


def skip_identity_chunk_sort() -> bool:
    """Apply ``moe_skip_identity_chunk_sort`` (once); True when newly installed."""
    from launcher.megatron import patches

    if "moe_skip_identity_chunk_sort" in patches.applied():
        return False
    return patches.apply("moe_skip_identity_chunk_sort")


def sequential_mlps(model) -> list:
    from megatron.core.transformer.moe.experts import SequentialMLP

    return [(n, m) for n, m in model.named_modules() if isinstance(m, SequentialMLP)]


def enable_grouped_experts(model) -> dict[str, Any]:
    """Group every eligible SequentialMLP of ``model``; {"grouped": [...], "kept": {name: why},
    "input_quantization": {name: {"fc1": shared|each|none, "fc2": ...}}}."""
    grouped, kept, quant = [], {}, {}
    mlps = sequential_mlps(model)
    if mlps:
        skip_identity_chunk_sort()
    for name, experts in mlps:
        why = _ineligible(experts)
        if why is not None:
            kept[name] = why
            continue
        fwd = GroupedExpertsForward(experts)
        experts.forward = fwd
        setattr(experts, _ATTR, fwd)
        grouped.append(name)
        quant[name] = {k: (p[0] if p else "none") for k, p in (("fc1", fwd.q1), ("fc2", fwd.q2))}
    return {"grouped": grouped, "kept": kept, "input_quantization": quant}


def disable_grouped_experts(model) -> int:
    """Restore the per-expert loop everywhere (the weights stay views of the stacks) and undo
    ``moe_skip_identity_chunk_sort``."""
    from launcher.megatron import patches

    n = 0
    for _, experts in sequential_mlps(model):
        if getattr(experts, _ATTR, None) is not None:
            del experts.forward
            setattr(experts, _ATTR, None)
            n += 1
    patches.undo("moe_skip_identity_chunk_sort")
    return n
