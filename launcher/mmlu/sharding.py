"""Which rank evaluates which batch, step by step - pure Python, computed identically everywhere.

Input: the batch shapes ``(rows, padded_len)`` (from ``batching``), the stage's ``ParallelDims``,
the shard mode and the MoE token dispatcher.  Output: ``ShardPlan.steps[rank]``, a list of
``Step(batch, padded_len, rows)``; ``batch is None`` is a dummy forward whose output is dropped.

Modes
* ``lockstep`` - shard over expert-DP when ep > 1 (else DP): every rank of an EP group evaluates
  the same batches, so EP peers trivially agree on every forward, at the price of redundancy (at
  EP=4 on 4 ranks every rank evaluates every batch).
* ``balanced`` (``auto``) - shard over DP: every DP rank has its own batches, dealt in snake
  order over batches sorted by padded tokens (largest first), which balances tokens and keeps
  per-rank batch counts within one of each other.  Ranks that meet in a forward's collectives
  (one "component": the union of their EP, TP, PP, CP and ETP groups) make the same number of
  forward calls: dummies fill the tail.  With the ``allgather`` dispatcher the component also
  agrees, per step, on the padded shape (max rows, max length of the step's batches; a dummy
  takes that shape); with ``alltoall`` a dummy is one row of the shortest padded length.
* ``dense_dp`` - shard over DP with no equalization: at ep > 1 EP peers make different numbers of
  forward calls and the expert all-to-all desyncs.  Refused at ep > 1 unless
  ``allow_unsafe_shard_mode`` (tests reproduce the desync with it; the guard stops it).

TP, CP and PP peers always share the DP index, so they see the same batches; ``plan_shards``
checks it.  Each batch is reported by exactly one rank (``owner``): the lowest rank on the last
pipeline stage that evaluates it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

from launcher.contract import Dispatcher, ShardMode, values
from launcher.topology import ParallelDims

SHARD_MODES = values(ShardMode)
DISPATCHERS = values(Dispatcher)
# groups whose ranks enter a forward's collectives together
FORWARD_GROUPS = ("tp", "pp", "cp", "ep", "etp")
PEER_GROUPS = ("tp", "pp", "cp")   # must evaluate identical batches


@dataclass(frozen=True)
class Step:
    batch: Optional[int]       # None: dummy
    padded_len: int
    rows: int


def resolve_mode(mode: str, ep: int, allow_unsafe: bool = False) -> str:
    """``auto`` -> ``balanced``; ValueError for an unknown mode or dense_dp at ep > 1."""
    if mode not in SHARD_MODES:
        raise ValueError(f"stages.mmlu.shard_mode={mode!r}: valid values are {list(SHARD_MODES)}")
    if mode == "dense_dp" and ep > 1 and not allow_unsafe:
        raise ValueError(
            f"stages.mmlu.shard_mode='dense_dp': shards batches over the dense data-parallel group, which "
            f"desyncs the expert all-to-all at ep={ep} (EP peers run different numbers of forwards); valid: "
            f"auto, balanced, lockstep (stages.mmlu.allow_unsafe_shard_mode=true permits it for tests)")
    return "balanced" if mode == "auto" else mode


@dataclass
class ShardPlan:
    mode: str
    dispatcher: str
    world_size: int
    n_batches: int
    n_shards: int
    shard_of_rank: list[int]
    steps: list[list[Step]]
    components: list[list[int]]          # ranks that must step together (guard groups)
    owner: dict[int, int] = field(default_factory=dict)   # batch -> reporting rank

    def for_rank(self, rank: int) -> list[Step]:
        return self.steps[rank]

    def component_of(self, rank: int) -> list[int]:
        for c in self.components:
            if rank in c:
                return c
        raise AssertionError(rank)

    def forward_calls(self) -> list[int]:
        return [len(s) for s in self.steps]

    def dummies(self) -> list[int]:
        return [sum(st.batch is None for st in s) for s in self.steps]

    def padded_tokens(self) -> list[int]:
        return [sum(st.rows * st.padded_len for st in s) for s in self.steps]

    def shard_padded_tokens(self) -> int:
        """Padded tokens (dummies included) summed over shards - one rank per shard index, so
        TP/PP/lockstep peers computing the same batches count once."""
        seen: dict[int, int] = {}
        for r, shard in enumerate(self.shard_of_rank):
            seen.setdefault(shard, sum(st.rows * st.padded_len for st in self.steps[r]))
        return sum(seen.values())

    def summary(self) -> dict:
        return {
            "mode": self.mode, "dispatcher": self.dispatcher, "n_batches": self.n_batches,
            "n_shards": self.n_shards, "shard_of_rank": self.shard_of_rank,
            "forward_calls_per_rank": self.forward_calls(),
            "real_batches_per_rank": [len(s) - d for s, d in zip(self.steps, self.dummies())],
            "dummies_per_rank": self.dummies(),
            "padded_tokens_per_rank": self.padded_tokens(),
            "components": self.components,
        }


def _components(dims: ParallelDims) -> list[list[int]]:
    parent = list(range(dims.world_size))

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for kind in FORWARD_GROUPS:
        for g in dims.groups[kind]:
            for r in g[1:]:
                parent[find(r)] = find(g[0])
    comps: dict[int, list[int]] = {}
    for r in range(dims.world_size):
        comps.setdefault(find(r), []).append(r)
    return sorted(comps.values())


def _deal(shapes: Sequence[tuple[int, int]], n_shards: int, snake: bool) -> list[list[int]]:
    shards: list[list[int]] = [[] for _ in range(n_shards)]
    if snake:
        order = sorted(range(len(shapes)), key=lambda i: (-shapes[i][0] * shapes[i][1], i))
    else:
        order = list(range(len(shapes)))
    for k, b in enumerate(order):
        rnd, pos = divmod(k, n_shards)
        shards[pos if (not snake or rnd % 2 == 0) else n_shards - 1 - pos].append(b)
    return shards


def plan_shards(shapes: Sequence[tuple[int, int]], dims: ParallelDims, mode: str = "auto",
                dispatcher: str = "alltoall", allow_unsafe: bool = False) -> ShardPlan:
    if dispatcher not in DISPATCHERS:
        raise ValueError(f"stages.mmlu.moe_dispatcher={dispatcher!r}: valid values are {list(DISPATCHERS)}")
    mode = resolve_mode(mode, dims.ep, allow_unsafe)
    shapes = [(int(r), int(n)) for r, n in shapes]
    for i, (r, n) in enumerate(shapes):
        if r < 1 or n < 1:
            raise ValueError(f"batch {i} has shape {(r, n)}; rows and padded_len must be >= 1")
    coords = [dims.coordinates(r) for r in range(dims.world_size)]
    if mode == "lockstep" and dims.ep > 1:
        shard_of_rank, n_shards = [c["edp"] for c in coords], dims.edp
    else:
        shard_of_rank, n_shards = [c["dp"] for c in coords], dims.dp
    dealt = _deal(shapes, n_shards, snake=(mode == "balanced"))
    per_rank: list[list[Step]] = [
        [Step(b, shapes[b][1], shapes[b][0]) for b in dealt[shard_of_rank[r]]]
        for r in range(dims.world_size)]
    components = _components(dims)
    if mode != "dense_dp":
        min_len = min((n for _, n in shapes), default=1)
        for comp in components:
            n_steps = max(len(per_rank[r]) for r in comp)
            for s in range(n_steps):
                real = [per_rank[r][s] for r in comp if s < len(per_rank[r])]
                if dispatcher == "allgather":
                    rows = max(st.rows for st in real)
                    plen = max(st.padded_len for st in real)
                    for r in comp:
                        if s < len(per_rank[r]):
                            per_rank[r][s] = Step(per_rank[r][s].batch, plen, rows)
                        else:
                            per_rank[r].append(Step(None, plen, rows))
                else:
                    for r in comp:
                        if s >= len(per_rank[r]):
                            per_rank[r].append(Step(None, min_len, 1))
    plan = ShardPlan(mode=mode, dispatcher=dispatcher, world_size=dims.world_size,
                     n_batches=len(shapes), n_shards=n_shards, shard_of_rank=shard_of_rank,
                     steps=per_rank, components=components)
    _check_peers(plan, dims)
    _assign_owners(plan, dims, coords)
    return plan


def _check_peers(plan: ShardPlan, dims: ParallelDims) -> None:
    for kind in PEER_GROUPS:
        for g in dims.groups[kind]:
            ref = plan.steps[g[0]]
            for r in g[1:]:
                if plan.steps[r] != ref:
                    raise ValueError(
                        f"shard_mode={plan.mode}: {kind} peers {g[0]} and {r} would evaluate "
                        f"different batches at tp={dims.tp} pp={dims.pp} ep={dims.ep} "
                        f"etp={dims.etp}; use shard_mode=balanced")


def _assign_owners(plan: ShardPlan, dims: ParallelDims, coords: list[dict]) -> None:
    last = dims.pp - 1
    for r in range(dims.world_size):
        if coords[r]["pp"] != last:
            continue
        for st in plan.steps[r]:
            if st.batch is not None and st.batch not in plan.owner:
                plan.owner[st.batch] = r
    missing = [b for b in range(plan.n_batches) if b not in plan.owner]
    if missing:
        raise AssertionError(f"batches {missing} are evaluated by no last-stage rank")
