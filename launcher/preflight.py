"""Preflight: this rank's Megatron-Core groups equal launcher.topology's, and every group talks.

Runs at the start of every stage worker (and alone with `launch CONFIG --preflight`): after
parallel_state is initialized, each group's ranks are compared with the pure-Python topology,
then one all-reduce per group proves the group is wired.  Any mismatch raises with the group,
the rank and both rank lists.
"""
from __future__ import annotations

from launcher.topology import ParallelDims

# topology.py group name -> megatron.core.parallel_state getter (kwargs)
_MEGATRON_GROUPS = {
    "tp": ("get_tensor_model_parallel_group", {}),
    "pp": ("get_pipeline_model_parallel_group", {}),
    "dp": ("get_data_parallel_group", {"with_context_parallel": False}),
    "cp": ("get_context_parallel_group", {}),
    "ep": ("get_expert_model_parallel_group", {}),
    "etp": ("get_expert_tensor_parallel_group", {}),
    "edp": ("get_expert_data_parallel_group", {}),
}


class PreflightError(RuntimeError):
    pass


def megatron_groups() -> dict[str, tuple[object, list[int]]]:
    """Megatron's process group and its global ranks, per group kind, for this rank."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    out = {}
    for kind, (getter, kwargs) in _MEGATRON_GROUPS.items():
        group = getattr(ps, getter)(**kwargs)
        out[kind] = (group, sorted(dist.get_process_group_ranks(group)))
    return out


def run_preflight(dims: ParallelDims, rank: int) -> dict[str, list[int]]:
    import torch
    import torch.distributed as dist

    problems = []
    groups = megatron_groups()
    for kind, (group, ranks) in groups.items():
        expected = sorted(dims.group_of(kind, rank))
        if ranks != expected:
            problems.append(f"{kind} group of rank {rank}: megatron {ranks} != topology {expected}")
    if problems:
        raise PreflightError("preflight: group mismatch:\n  " + "\n  ".join(problems))
    for kind, (group, ranks) in groups.items():
        t = torch.ones(1)
        dist.all_reduce(t, group=group)
        if int(t.item()) != len(ranks):
            raise PreflightError(f"preflight: all-reduce over the {kind} group {ranks} gave {int(t.item())}, "
                                 f"expected {len(ranks)}")
    return {kind: ranks for kind, (_, ranks) in groups.items()}
