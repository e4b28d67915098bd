"""Length-sorted batches bounded by rows and by padded tokens - pure Python.

Prompts are sorted longest first (stable: ties keep prompt order), then cut greedily: a batch
closes when it has ``batch_size`` rows, when one more row would make
``rows * padded_len > max_batch_tokens`` (padded_len is the batch's first, longest prompt), or,
with ``min_fill``, when the next prompt is shorter than ``min_fill * padded_len`` (so every row of
a batch fills at least that fraction of it: padding efficiency >= ``min_fill`` batch by batch).
A single prompt longer than the budget still gets a batch of its own.

``stages.mmlu.batch_size: auto`` (the default) is resolved by ``resolve_limits``:

* on CPU: 8 rows and ``max_batch_tokens`` as given (the behaviour before ``auto`` existed);
* on CUDA: no row limit; the token budget is ``max_batch_tokens`` when set, else
  ``auto_batch_tokens`` - a power of two between 4,096 and 65,536 tokens chosen from the
  device's memory and the model's per-token activation size - and the fill cut that minimizes
  ``padded tokens + overhead_tokens * forwards`` over ``FILL_CANDIDATES`` (``choose_min_fill``).
  ``overhead_tokens`` is a forward's fixed cost in tokens' worth of work, set from the H200
  measurements (benchmarks/mmlu_gpu.py): dense 1,500 - fill 0.8's 14 forwards beat fill 0.9's
  28 (0.850 vs 0.923 s bf16; 1.0 vs 1.39 s NVFP4, whose 64 quantized linears add ~30 ms of host
  work per forward), which 500 had chosen; MoE 2,000 - fill 0.6's 5 forwards ran 0.097 s, fill
  0.8's 11 0.141 s (each MoE layer syncs with the host and launches ~20 small kernels).

An integer ``batch_size`` keeps exactly the old rule (rows and optional budget, no fill cut).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

AUTO = "auto"
CPU_AUTO_ROWS = 8                 # auto on CPU: the pre-auto default
AUTO_MIN_FILL = 0.8               # the benchmark sweep's fill cut (every row >= 80% of its batch)
FILL_CANDIDATES = (None, 0.5, 0.6, 0.7, 0.8, 0.9)
OVERHEAD_TOKENS_DENSE, OVERHEAD_TOKENS_MOE = 1500, 2000
AUTO_TOKENS_MIN, AUTO_TOKENS_MAX = 4096, 65536
AUTO_MEMORY_FRACTION = 0.10       # share of device memory one forward's activations may take


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


@dataclass(frozen=True)
class BatchLimits:
    """What ``make_batches`` gets: resolved from ``stages.mmlu.batch_size``/``max_batch_tokens``."""

    rows: Optional[int]              # None: no row limit
    max_tokens: Optional[int]        # None: no token budget
    min_fill: Optional[float] = None
    source: str = "explicit"         # explicit | auto-cpu | auto-device | auto-max_batch_tokens | sweep
    overhead_tokens: Optional[int] = None   # set: min_fill is chosen per prompt set (choose_min_fill)

    def summary(self) -> dict:
        return {"rows": self.rows, "max_batch_tokens": self.max_tokens, "min_fill": self.min_fill,
                "overhead_tokens": self.overhead_tokens, "source": self.source}


def check_batch_size(batch_size) -> None:
    """ValueError naming the key unless ``batch_size`` is 'auto' or an integer >= 1."""
    if batch_size == AUTO:
        return
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"stages.mmlu.batch_size={batch_size!r}: valid: 'auto' (token budget from the "
                         f"device) or an integer >= 1")


def activation_bytes_per_token(hidden: int, ffn: int, topk: int = 0, moe_ffn: int = 0,
                               dtype_bytes: int = 2) -> int:
    """A coarse size of the activations one token keeps alive in a forward (the widest layer):
    a few hidden-size tensors, the MLP's gated intermediate, and for MoE ``topk`` copies of the
    token and of the expert intermediate."""
    dense = 4 * hidden + 3 * ffn
    moe = (2 + 2 * topk) * hidden + 3 * topk * moe_ffn if topk else 0
    return dtype_bytes * max(dense, moe)


def auto_batch_tokens(device_memory_bytes: int, bytes_per_token: int) -> int:
    """The largest power of two of tokens whose activations fit in AUTO_MEMORY_FRACTION of the
    device, clamped to [AUTO_TOKENS_MIN, AUTO_TOKENS_MAX]."""
    if device_memory_bytes <= 0 or bytes_per_token <= 0:
        raise ValueError(f"device memory {device_memory_bytes} and bytes per token {bytes_per_token} "
                         f"must be positive")
    fit = int(AUTO_MEMORY_FRACTION * device_memory_bytes // bytes_per_token)
    tokens = AUTO_TOKENS_MIN
    while tokens * 2 <= min(fit, AUTO_TOKENS_MAX):
        tokens *= 2
    return tokens


def resolve_limits(batch_size, max_batch_tokens: Optional[int], device: str,
                   device_memory_bytes: Optional[int] = None,
                   bytes_per_token: Optional[int] = None, moe: bool = False) -> BatchLimits:
    """``batch_size`` (int or 'auto') + ``max_batch_tokens`` on ``device`` -> BatchLimits."""
    check_batch_size(batch_size)
    _check_tokens(max_batch_tokens)
    if batch_size != AUTO:
        return BatchLimits(int(batch_size), max_batch_tokens, None, "explicit")
    if device != "cuda":
        return BatchLimits(CPU_AUTO_ROWS, max_batch_tokens, None, "auto-cpu")
    overhead = OVERHEAD_TOKENS_MOE if moe else OVERHEAD_TOKENS_DENSE
    if max_batch_tokens is not None:
        return BatchLimits(None, max_batch_tokens, None, "auto-max_batch_tokens", overhead)
    if device_memory_bytes is None or bytes_per_token is None:
        raise ValueError("batch_size=auto on cuda needs the device memory and the model's bytes per "
                         "token (or set stages.mmlu.max_batch_tokens)")
    return BatchLimits(None, auto_batch_tokens(device_memory_bytes, bytes_per_token), None,
                       "auto-device", overhead)


def batch_cost(batches: Sequence["Batch"], overhead_tokens: int) -> int:
    """Padded tokens plus ``overhead_tokens`` per forward: what ``choose_min_fill`` minimizes."""
    return sum(b.padded_tokens for b in batches) + overhead_tokens * len(batches)


def choose_min_fill(lengths: Sequence[int], rows: Optional[int], max_tokens: Optional[int],
                    overhead_tokens: int) -> Optional[float]:
    """The fill cut of FILL_CANDIDATES with the lowest ``batch_cost`` (ties: the earlier one)."""
    costs = [(batch_cost(make_batches(lengths, rows, max_tokens, f), overhead_tokens), i)
             for i, f in enumerate(FILL_CANDIDATES)]
    return FILL_CANDIDATES[min(costs)[1]]


def _check_tokens(max_batch_tokens) -> None:
    if max_batch_tokens is not None and (isinstance(max_batch_tokens, bool)
                                         or not isinstance(max_batch_tokens, int) or max_batch_tokens < 1):
        raise ValueError(f"stages.mmlu.max_batch_tokens={max_batch_tokens!r}: must be null or an "
                         f"integer >= 1")


def make_batches(lengths: Sequence[int], batch_size: Optional[int],
                 max_batch_tokens: Optional[int] = None,
                 min_fill: Optional[float] = None) -> list[Batch]:
    """``batch_size`` None: no row limit (then a budget or min_fill usually bounds the batch)."""
    if batch_size is not None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"stages.mmlu.batch_size={batch_size!r}: must be an integer >= 1")
    _check_tokens(max_batch_tokens)
    if min_fill is not None and not 0 < min_fill <= 1:
        raise ValueError(f"min_fill={min_fill!r}: must be in (0, 1]")
    for i, n in enumerate(lengths):
        if n < 1:
            raise ValueError(f"prompt {i} has {n} tokens; every prompt needs at least one")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[Batch] = []
    cur: list[int] = []
    for i in order:
        if cur:
            padded = lengths[cur[0]]
            full = batch_size is not None and len(cur) >= batch_size
            over = max_batch_tokens is not None and (len(cur) + 1) * padded > max_batch_tokens
            thin = min_fill is not None and lengths[i] < min_fill * padded
            if full or over or thin:
                batches.append(_batch(cur, lengths))
                cur = []
        cur.append(i)
    if cur:
        batches.append(_batch(cur, lengths))
    return batches


def make_batches_for(lengths: Sequence[int], limits: BatchLimits) -> list[Batch]:
    fill = limits.min_fill
    if fill is None and limits.overhead_tokens is not None and lengths:
        fill = choose_min_fill(lengths, limits.rows, limits.max_tokens, limits.overhead_tokens)
    return make_batches(lengths, limits.rows, limits.max_tokens, fill)


def _batch(items: list[int], lengths: Sequence[int]) -> Batch:
    lens = tuple(lengths[i] for i in items)
    return Batch(items=tuple(items), lengths=lens, padded_len=max(lens))


def padding_efficiency(batches: Sequence[Batch], padded_tokens: Optional[int] = None) -> float:
    """Real tokens / padded tokens (``padded_tokens`` overrides the batches' own padded total,
    e.g. with the plan's shape equalization and dummy steps counted)."""
    real = sum(b.real_tokens for b in batches)
    padded = padded_tokens if padded_tokens is not None else sum(b.padded_tokens for b in batches)
    return real / padded if padded else 1.0
