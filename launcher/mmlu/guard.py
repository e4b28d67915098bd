"""Desync guard: before every forward, the ranks that must step together agree - or fail at once.

Protocol (per component of the plan: the ranks joined by EP/TP/PP/CP/ETP groups):

* before forward ``s`` a rank calls ``check(s, n_steps, padded_len, rows)``; after its last step
  it calls ``finish(n_steps)`` - one all-gather per call of a record
  ``(step, n_steps, padded_len, rows, done, shape_key, plan digest)`` on a dedicated gloo group
  with the stage's ``collective_timeout_s``;
* every rank therefore makes its k-th guard call at its k-th step (or at its end): the first
  call already exchanges ``n_steps``, so a disagreement is seen by every rank at the same call,
  and all raise ``DesyncError`` together (no rank is left waiting in a model collective); a rank
  with no steps still makes the ``finish`` call and is compared;
* shapes (padded_len, rows) must be equal between ranks of the same ``shape_key``: the whole
  component with the allgather dispatcher, ranks of the same shard (TP/PP peers) otherwise;
* a peer that never arrives (crashed, stuck) makes the all-gather time out after
  ``timeout_s``: reported as a DesyncError naming the step and the group, not a 600 s hang.

Components of one rank (dense model, no model parallelism) need no collective.
"""
from __future__ import annotations

import datetime
import time
from typing import Optional

from launcher.contract import ExitCode, StageFailed


class DesyncError(StageFailed):
    def __init__(self, message: str):
        super().__init__(message, exit_code=ExitCode.DESYNC)


FIELDS = ("step", "n_steps", "padded_len", "rows", "done", "shape_key", "plan")


def plan_digest(plan) -> int:
    """63-bit digest of the whole plan: ranks that tokenized different data disagree on it."""
    import hashlib
    import json

    blob = json.dumps([plan.mode, plan.dispatcher, plan.world_size,
                       [[(s.batch, s.padded_len, s.rows) for s in st] for st in plan.steps]])
    return int(hashlib.sha256(blob.encode()).hexdigest()[:15], 16)


def make_groups(plan, timeout_s: float):
    """One gloo group per multi-rank component (every rank calls this, same order).

    Returns {component index: group}."""
    import torch.distributed as dist

    groups = {}
    for i, comp in enumerate(plan.components):
        if len(comp) > 1:
            groups[i] = dist.new_group(ranks=comp, timeout=datetime.timedelta(seconds=timeout_s),
                                       backend="gloo")
    return groups


class StepGuard:
    def __init__(self, plan, rank: int, groups: dict, stage: str = "mmlu",
                 timeout_s: float = 45.0, label: str = ""):
        self.plan, self.rank, self.stage, self.timeout_s, self.label = plan, rank, stage, timeout_s, label
        self.comp_index = next(i for i, c in enumerate(plan.components) if rank in c)
        self.ranks = plan.components[self.comp_index]
        self.group = groups.get(self.comp_index)
        self.check_shapes_all = plan.dispatcher == "allgather"
        self.shape_key = 0 if self.check_shapes_all else plan.shard_of_rank[rank]
        self.digest = plan_digest(plan)
        self.calls = 0

    def check(self, step: int, n_steps: int, padded_len: int, rows: int) -> None:
        self._exchange([step, n_steps, padded_len, rows, 0, self.shape_key, self.digest])

    def finish(self, n_steps: int) -> None:
        self._exchange([n_steps, n_steps, -1, -1, 1, self.shape_key, self.digest])

    def _exchange(self, record: list[int]) -> None:
        self.calls += 1
        if self.group is None:
            return
        import torch
        import torch.distributed as dist

        mine = torch.tensor(record, dtype=torch.int64)
        out = [torch.zeros_like(mine) for _ in self.ranks]
        t0 = time.time()
        try:
            dist.all_gather(out, mine, group=self.group)
        except RuntimeError as e:
            raise DesyncError(
                f"{self.stage}{self._label()}: desync guard: ranks {self.ranks} did not all reach "
                f"guard call {self.calls} (this rank: step {record[0]}/{record[1]}) within "
                f"{self.timeout_s:g} s (waited {time.time() - t0:.1f} s): a peer failed or is stuck "
                f"({type(e).__name__}: {str(e).splitlines()[0][:200]})") from e
        records = {r: dict(zip(FIELDS, t.tolist())) for r, t in zip(self.ranks, out)}
        problem = self._problem(records)
        if problem:
            detail = "; ".join(
                f"rank {r}: " + ("done" if v["done"] else f"step {v['step']}")
                + f"/{v['n_steps']} steps" + ("" if v["done"] else f", shape {v['rows']}x{v['padded_len']}")
                for r, v in records.items())
            raise DesyncError(
                f"{self.stage}{self._label()}: desync guard tripped before forward "
                f"{record[0]} (shard_mode={self.plan.mode}, dispatcher={self.plan.dispatcher}): "
                f"{problem}. Ranks {self.ranks}: {detail}")

    def _label(self) -> str:
        return f" [{self.label}]" if self.label else ""

    def _problem(self, records: dict[int, dict]) -> Optional[str]:
        def differ(key):
            return len({v[key] for v in records.values()}) > 1

        if differ("plan"):
            return "ranks computed different shard plans (different data, tokenizer or config?)"
        if differ("n_steps"):
            return "ranks disagree on the number of forward steps"
        if differ("step") or differ("done"):
            return "ranks are at different steps"
        if not next(iter(records.values()))["done"]:
            by_key: dict[int, set] = {}
            for v in records.values():
                by_key.setdefault(v["shape_key"], set()).add((v["rows"], v["padded_len"]))
            if any(len(s) > 1 for s in by_key.values()):
                what = "the EP group" if self.check_shapes_all else "TP/PP peers"
                return f"{what} disagree on the padded batch shape (rows x padded_len)"
        return None
