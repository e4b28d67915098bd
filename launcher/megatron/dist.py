"""torch.distributed + Megatron-Core parallel_state for one rank of a stage.

Rendezvous is env:// (RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT, LOCAL_RANK, NODE_RANK), with
Slurm's SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID / SLURM_NODEID as the fallback under ``srun``.
CPU runs use gloo (and ``cpu_compat``), CUDA runs NCCL on ``cuda:LOCAL_RANK``.  A gloo stage that
spans nodes binds to the interface that routes to MASTER_ADDR unless GLOO_SOCKET_IFNAME says
otherwise: gloo's own choice is the address the machine's hostname resolves to, which on a stock
Debian/Ubuntu host is loopback (/etc/hosts), and peers on other nodes then cannot connect.
"""
from __future__ import annotations

import datetime
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from launcher.topology import ParallelDims

DEVICES = ("cpu", "cuda")


def rank_env() -> dict[str, int]:
    """This process's rank, world size, local rank, local world size, node rank and node count from
    torchrun's or Slurm's variables (local ones default to the global ones: a single node)."""
    def pick(*names: str) -> int | None:
        for name in names:
            value = os.environ.get(name)
            if value not in (None, ""):
                try:
                    return int(value)
                except ValueError:
                    raise ValueError(f"environment variable {name}={value!r} is not an integer")
        return None

    rank = pick("RANK", "SLURM_PROCID")
    world = pick("WORLD_SIZE", "SLURM_NTASKS")
    if rank is None or world is None:
        raise ValueError(
            "cannot tell this process's rank: set RANK and WORLD_SIZE (torchrun / local executor) "
            "or run under srun (SLURM_PROCID, SLURM_NTASKS)")
    local = pick("LOCAL_RANK", "SLURM_LOCALID")
    node = pick("NODE_RANK", "GROUP_RANK", "SLURM_NODEID")
    local_world = pick("LOCAL_WORLD_SIZE")
    if local_world is None and node is not None:   # srun: this node's count (distributions may be uneven)
        from launcher.slurm_env import tasks_on_node

        local_world = tasks_on_node(os.environ.get("SLURM_STEP_TASKS_PER_NODE", ""), node)
    if local_world is None:
        local_world = pick("SLURM_NTASKS_PER_NODE")
    nodes = pick("NNODES", "GROUP_WORLD_SIZE", "SLURM_STEP_NUM_NODES", "SLURM_NNODES")
    local_world = world if local_world is None else local_world
    return {"rank": rank, "world_size": world, "local_rank": rank if local is None else local,
            "local_world_size": local_world, "node_rank": 0 if node is None else node,
            "num_nodes": nodes if nodes is not None else -(-world // max(local_world, 1))}


def interface_towards(host: str) -> tuple[str, str] | None:
    """(interface, local address) this machine uses to reach ``host``; None if none is found.

    A connected UDP socket makes the kernel pick the route without sending anything.
    """
    import socket

    import psutil

    try:
        addr = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_DGRAM)[0][4][0]
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((addr, 9))
            local = s.getsockname()[0]
    except OSError:
        return None
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == local for a in addrs):
            return name, local
    return None


def choose_gloo_interface(env: dict[str, int]) -> str | None:
    """Set GLOO_SOCKET_IFNAME for a stage that spans nodes (see the module docstring); returns it."""
    if os.environ.get("GLOO_SOCKET_IFNAME") or env["num_nodes"] <= 1:
        return os.environ.get("GLOO_SOCKET_IFNAME")
    found = interface_towards(os.environ["MASTER_ADDR"])
    if found is None or found[1].startswith("127."):
        return None   # MASTER_ADDR is loopback or unroutable: nothing better to offer than gloo's own choice
    os.environ["GLOO_SOCKET_IFNAME"] = found[0]
    return found[0]


def init_distributed(dims: "ParallelDims", device: str, timeout_s: float = 120, seed: int = 1234,
                     architecture: str | None = None):
    """Initialize torch.distributed and Megatron's parallel_state for ``dims``; seed the RNGs.

    Returns megatron.core.parallel_state.  ``device`` is "cpu" (gloo, CPU shims) or "cuda"
    (NCCL, one GPU per local rank).  ``architecture`` (the HF ``architectures[0]`` this rank will
    build): a hybrid (Mamba) one gets the ``mamba_ssm_stub`` patch first, before anything can
    import megatron.core.ssm; other ranks never see the stub.
    """
    if device not in DEVICES:
        raise ValueError(f"device={device!r} is not valid; valid values: {list(DEVICES)}")
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
    from launcher.megatron import patches
    from launcher.architectures import is_hybrid

    if is_hybrid(architecture):
        patches.apply("mamba_ssm_stub")
    import torch
    import torch.distributed as dist

    env = rank_env()
    if env["world_size"] != dims.world_size:
        raise ValueError(
            f"the launcher started {env['world_size']} ranks but the stage's parallel layout "
            f"needs world_size={dims.world_size} ({dims.describe()})")
    os.environ.setdefault("RANK", str(env["rank"]))
    os.environ.setdefault("WORLD_SIZE", str(env["world_size"]))
    os.environ.setdefault("LOCAL_RANK", str(env["local_rank"]))
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if not os.environ.get(name):
            raise ValueError(f"environment variable {name} is not set (needed for env:// rendezvous)")

    if device == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device='cuda' but torch.cuda.is_available() is False on this node")
        torch.cuda.set_device(env["local_rank"] % torch.cuda.device_count())
        backend = "nccl"
    else:
        from launcher.megatron.cpu_compat import apply_cpu_compat

        apply_cpu_compat()
        backend = "gloo"
        choose_gloo_interface(env)

    if not dist.is_initialized():
        dist.init_process_group(
            backend=backend, init_method="env://", rank=env["rank"], world_size=env["world_size"],
            timeout=datetime.timedelta(seconds=timeout_s))

    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=dims.tp,
        pipeline_model_parallel_size=dims.pp,
        context_parallel_size=dims.cp,
        expert_model_parallel_size=dims.ep,
        expert_tensor_parallel_size=dims.etp,
        distributed_timeout_minutes=timeout_s / 60.0,
    )
    seed_everything(seed, device)
    return parallel_state


def seed_everything(seed: int, device: str) -> None:
    """Same seed on every rank for torch; Megatron's model-parallel RNG tracker seeded too."""
    import random

    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if device == "cuda":
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(seed)
    else:
        from launcher.megatron.cpu_compat import seed_megatron_rng_cpu

        seed_megatron_rng_cpu(seed)


# topology.ParallelDims.groups kind -> (parallel_state getter, kwargs)
_GROUP_GETTERS = {
    "tp": ("get_tensor_model_parallel_group", {}),
    "pp": ("get_pipeline_model_parallel_group", {}),
    "dp": ("get_data_parallel_group", {"with_context_parallel": False}),
    "cp": ("get_context_parallel_group", {}),
    "dp_cp": ("get_data_parallel_group", {"with_context_parallel": True}),
    "mp": ("get_model_parallel_group", {}),
    "ep": ("get_expert_model_parallel_group", {}),
    "etp": ("get_expert_tensor_parallel_group", {}),
    "edp": ("get_expert_data_parallel_group", {}),
    "expert_mp": ("get_expert_tensor_and_model_parallel_group", {}),
}


def megatron_groups() -> dict[str, tuple[object, list[int]]]:
    """This rank's Megatron process groups and their global ranks, keyed like ParallelDims.groups."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    out = {}
    for kind, (getter, kwargs) in _GROUP_GETTERS.items():
        group = getattr(parallel_state, getter)(**kwargs)
        out[kind] = (group, sorted(dist.get_process_group_ranks(group)))
    return out


def megatron_group_ranks() -> dict[str, list[int]]:
    """This rank's Megatron groups as global rank lists, keyed like ParallelDims.groups."""
    return {kind: ranks for kind, (_, ranks) in megatron_groups().items()}


def shutdown() -> None:
    """Destroy Megatron's groups and the default process group (safe to call twice)."""
    import torch.distributed as dist

    try:
        from megatron.core import parallel_state

        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
