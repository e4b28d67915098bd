"""Where one forward's time goes: torch.profiler kernel time by class (not product code).

``profile_call(fn, sync, cuda)`` runs ``fn`` once under the profiler and returns the wall time,
the summed kernel time (GPU busy; on CPU the aten ops' self time), that time split by class
(gemm, attention, quantization, norm, moe routing/permutation, copy/cast, elementwise, other),
the idle share (wall - busy: launch and host overhead) and the 15 costliest kernels.
"""
from __future__ import annotations

import re
import time

CLASSES = (
    ("quant", re.compile(r"fp4|e4m3|fake_quant|quant|fp8", re.I)),
    ("attention", re.compile(r"flash|fmha|attention|sdpa|softmax|baddbmm|bmm", re.I)),
    ("gemm", re.compile(r"gemm|cutlass|xmma|nvjet|sm90_|matmul|aten::mm|addmm|_grouped_mm|cublas", re.I)),
    ("norm", re.compile(r"norm|rsqrt", re.I)),
    ("moe_routing", re.compile(r"sort|topk|scatter|gather|index|histc|bincount|cumsum|nonzero", re.I)),
    ("copy_cast", re.compile(r"copy|cat|to_copy|contiguous|fill|memcpy|memset", re.I)),
    ("elementwise", re.compile(r"elementwise|vectorized|silu|mul|add|triton|pointwise|unrolled", re.I)),
)


def classify(name: str) -> str:
    for cls, rule in CLASSES:
        if rule.search(name):
            return cls
    return "other"


def profile_call(fn, sync, cuda: bool) -> dict:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync()
    with profile(activities=activities) as prof:
        t = time.perf_counter()
        fn()
        sync()
        wall = time.perf_counter() - t
    from torch.autograd import DeviceType

    rows = []
    for e in prof.key_averages():
        if cuda:   # kernels only (aten ops would count their kernels a second time)
            if e.device_type != DeviceType.CUDA:
                continue
            us = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
        else:      # CPU: the aten ops' own time
            if not e.key.startswith("aten::"):
                continue
            us = e.self_cpu_time_total
        if us > 0:
            rows.append((e.key, us / 1e3, e.count))
    busy = sum(ms for _, ms, _ in rows)
    by_class: dict[str, float] = {}
    for name, ms, _ in rows:
        by_class[classify(name)] = by_class.get(classify(name), 0.0) + ms
    top = sorted(rows, key=lambda r: -r[1])[:15]
    return {"wall_ms": wall * 1e3, "busy_ms": busy, "idle_share": max(0.0, 1 - busy / (wall * 1e3)),
            "by_class_ms": {k: round(v, 3) for k, v in sorted(by_class.items(), key=lambda kv: -kv[1])},
            "top": [{"name": n[:120], "ms": round(ms, 3), "calls": c} for n, ms, c in top]}
