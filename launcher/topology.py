"""Rank topology in Megatron-Core's order - pure Python, no torch.

Megatron-Core lays ranks out with two generators that share the pipeline dimension:

* the dense (decoder) side: tp-cp-dp-pp, with dp = world / (tp * cp * pp);
* the expert side:          etp-ep-edp-pp, with edp = world / (etp * ep * pp).

Both follow ``order = "tp-cp-ep-dp-pp"`` (tp varies fastest).  ``ParallelDims`` validates the
degrees and builds every group lazily; ``tests/test_topology.py`` proves the groups equal those
of megatron-core's own ``RankGenerator`` for every valid combination up to 16 ranks.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

ORDER = ("tp", "cp", "ep", "dp", "pp")


def _prefix_product(sizes: list[int]) -> list[int]:
    out, acc = [1], 1
    for s in sizes:
        acc *= s
        out.append(acc)
    return out


def _decompose(index: int, shape: list[int]) -> list[int]:
    stride = _prefix_product(shape)
    return [(index // d) % s for s, d in zip(shape, stride)]


def orthogonal_groups(sizes: dict[str, int], token: str) -> list[list[int]]:
    """Groups of ranks that vary along the dimensions named in ``token`` (e.g. "tp-pp").

    ``sizes`` maps each of ORDER's names to its degree; the world is their product.  This is the
    masked orthogonal decomposition Megatron-Core uses (tp fastest, pp slowest).
    """
    names = token.split("-")
    for n in names:
        assert n in ORDER, f"unknown dimension {n!r} in {token!r}"
    shape = [sizes[n] for n in ORDER]
    mask = [n in names for n in ORDER]
    world = math.prod(shape)
    stride = _prefix_product(shape)
    masked_shape = [s for s, m in zip(shape, mask) if m]
    unmasked_shape = [s for s, m in zip(shape, mask) if not m]
    masked_stride = [d for d, m in zip(stride, mask) if m]
    unmasked_stride = [d for d, m in zip(stride, mask) if not m]
    group_size = math.prod(masked_shape)
    groups = []
    for g in range(world // group_size):
        base = sum(i * d for i, d in zip(_decompose(g, unmasked_shape), unmasked_stride))
        groups.append([
            base + sum(i * d for i, d in zip(_decompose(r, masked_shape), masked_stride))
            for r in range(group_size)
        ])
    return groups


def minimal_world_size(tp: int, pp: int, cp: int, ep: int, etp: int) -> int:
    """Smallest world both the dense and the expert layout divide."""
    return pp * math.lcm(tp * cp, etp * ep)


@dataclass(frozen=True)
class ParallelDims:
    """Validated parallel degrees of one stage. Groups are computed on first use."""

    world_size: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int = 1

    def __post_init__(self) -> None:
        for name in ("world_size", "tp", "pp", "cp", "ep", "etp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        dense = self.tp * self.cp * self.pp
        if self.world_size % dense:
            raise ValueError(
                f"world_size {self.world_size} is not divisible by tp({self.tp}) * cp({self.cp}) * "
                f"pp({self.pp}) = {dense}; valid world sizes are multiples of {dense}")
        expert = self.etp * self.ep * self.pp
        if self.world_size % expert:
            raise ValueError(
                f"world_size {self.world_size} is not divisible by etp({self.etp}) * ep({self.ep}) * "
                f"pp({self.pp}) = {expert}; valid world sizes are multiples of {expert}")

    @classmethod
    def from_stage(cls, cfg, stage: str) -> "ParallelDims":
        """The degrees of ``cfg.stages[stage].parallel`` (a composed pipeline config), with the world
        size defaulted to the smallest the degrees divide; ValueError when they do not fit together.
        vllm_smoke is one launcher rank (vLLM starts its own tensor-parallel workers)."""
        if stage == "vllm_smoke":
            return cls(world_size=1)
        p = cfg.stages[stage].parallel
        world = p.world_size or minimal_world_size(p.tp, p.pp, p.cp, p.ep, p.etp)
        return cls(world_size=world, tp=p.tp, pp=p.pp, cp=p.cp, ep=p.ep, etp=p.etp)

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.cp * self.pp)

    @property
    def edp(self) -> int:
        return self.world_size // (self.etp * self.ep * self.pp)

    @cached_property
    def _dense_sizes(self) -> dict[str, int]:
        return {"tp": self.tp, "cp": self.cp, "ep": 1, "dp": self.dp, "pp": self.pp}

    @cached_property
    def _expert_sizes(self) -> dict[str, int]:
        return {"tp": self.etp, "cp": 1, "ep": self.ep, "dp": self.edp, "pp": self.pp}

    @cached_property
    def groups(self) -> dict[str, list[list[int]]]:
        d, e = self._dense_sizes, self._expert_sizes
        return {
            "tp": orthogonal_groups(d, "tp"),
            "pp": orthogonal_groups(d, "pp"),
            "dp": orthogonal_groups(d, "dp"),
            "cp": orthogonal_groups(d, "cp"),
            "dp_cp": orthogonal_groups(d, "dp-cp"),
            "mp": orthogonal_groups(d, "tp-pp"),
            "ep": orthogonal_groups(e, "ep"),
            "etp": orthogonal_groups(e, "tp"),
            "edp": orthogonal_groups(e, "dp"),
            "expert_mp": orthogonal_groups(e, "tp-ep"),
        }

    def group_of(self, kind: str, rank: int) -> list[int]:
        for g in self.groups[kind]:
            if rank in g:
                return g
        raise AssertionError(f"rank {rank} in no {kind} group (world {self.world_size})")

    def coordinates(self, rank: int) -> dict[str, int]:
        """Rank's index along every dimension (dense and expert side)."""
        assert 0 <= rank < self.world_size, rank
        out = {}
        for kind in ("tp", "pp", "dp", "cp", "ep", "etp", "edp"):
            out[kind] = self.group_of(kind, rank).index(rank)
        return out

    def describe(self) -> dict:
        return {"world_size": self.world_size, "tp": self.tp, "pp": self.pp, "ep": self.ep,
                "etp": self.etp, "cp": self.cp, "dp": self.dp, "edp": self.edp}
