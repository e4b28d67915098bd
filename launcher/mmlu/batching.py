"""Length-sorted batches bounded by rows and by padded tokens - pure Python.

Prompts are sorted longest first (stable: ties keep prompt order), then cut greedily: a batch
closes when it has ``batch_size`` rows or when one more row would make
``rows * padded_len > max_batch_tokens`` (padded_len is the batch's first, longest prompt).  A
single prompt longer than the budget still gets a batch of its own.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence


@dataclass(frozen=True)
class Batch:
    items: tuple[int, ...]      # prompt indices, longest first
    lengths: tuple[int, ...]    # their real token counts
    padded_len: int

    @property
    def rows(self) -> int:
        return len(self.items)

    @property
    def real_tokens(self) -> int:
        return sum(self.lengths)

    @property
    def padded_tokens(self) -> int:
        return self.rows * self.padded_len

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.padded_len)


def make_batches(lengths: Sequence[int], batch_size: int,
                 max_batch_tokens: Optional[int] = None) -> list[Batch]:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"stages.mmlu.batch_size={batch_size!r}: must be an integer >= 1")
    if max_batch_tokens is not None and (not isinstance(max_batch_tokens, int) or max_batch_tokens < 1):
        raise ValueError(f"stages.mmlu.max_batch_tokens={max_batch_tokens!r}: must be null or an "
                         f"integer >= 1")
    for i, n in enumerate(lengths):
        if n < 1:
            raise ValueError(f"prompt {i} has {n} tokens; every prompt needs at least one")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[Batch] = []
    cur: list[int] = []
    for i in order:
        if cur:
            padded = lengths[cur[0]]
            full = len(cur) >= batch_size
            over = max_batch_tokens is not None and (len(cur) + 1) * padded > max_batch_tokens
            if full or over:
                batches.append(_batch(cur, lengths))
                cur = []
        cur.append(i)
    if cur:
        batches.append(_batch(cur, lengths))
    return batches


def _batch(items: list[int], lengths: Sequence[int]) -> Batch:
    lens = tuple(lengths[i] for i in items)
    return Batch(items=tuple(items), lengths=lens, padded_len=max(lens))


def padding_efficiency(batches: Sequence[Batch], padded_tokens: Optional[int] = None) -> float:
    """Real tokens / padded tokens (``padded_tokens`` overrides the batches' own padded total,
    e.g. with the plan's shape equalization and dummy steps counted)."""
    real = sum(b.real_tokens for b in batches)
    padded = padded_tokens if padded_tokens is not None else sum(b.padded_tokens for b in batches)
    return real / padded if padded else 1.0
