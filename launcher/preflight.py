"""Preflight: this rank's Megatron-Core groups equal launcher.topology's, and every group talks.

Runs at the start of every stage worker (and alone with `launch CONFIG --preflight`): after
parallel_state is initialized, each group's ranks are compared with the pure-Python topology,
then one all-reduce per group proves the group is wired.  Any mismatch raises with the group,
the rank and both rank lists.
"""
from __future__ import annotations

from launcher.topology import ParallelDims


class PreflightError(RuntimeError):
    pass


def run_preflight(dims: ParallelDims, rank: int) -> dict[str, list[int]]:
    import torch
    import torch.distributed as dist

    from launcher.megatron.dist import megatron_groups

    problems = []
    groups = megatron_groups()
    for kind, (group, ranks) in groups.items():
        expected = sorted(dims.group_of(kind, rank))
        if ranks != expected:
            problems.append(f"{kind} group of rank {rank}: megatron {ranks} != topology {expected}")
    if problems:
        raise PreflightError("preflight: group mismatch:\n  " + "\n  ".join(problems))
    for kind, (group, ranks) in groups.items():
        # NCCL reduces device tensors only; gloo CPU tensors
        device = f"cuda:{torch.cuda.current_device()}" if dist.get_backend(group) == "nccl" else "cpu"
        t = torch.ones(1, device=device)
        dist.all_reduce(t, group=group)
        if int(t.item()) != len(ranks):
            raise PreflightError(f"preflight: all-reduce over the {kind} group {ranks} gave {int(t.item())}, "
                                 f"expected {len(ranks)}")
    return {kind: ranks for kind, (_, ranks) in groups.items()}
