"""ModelOpt's ``megatron_mmlu`` as the benchmark's reference evaluator (not product code).

* ``ref_prompt`` / ``ref_selection``: its zero-shot prompt and per-subject selection, re-derived
  so the benchmark can check that both evaluators see the same questions;
* ``run_reference``: one ``megatron_mmlu`` call on a model, timed, with its four choice logits
  recorded by wrapping its ``megatron_prefill``;
* ``cpu_reference_shims``: the CPU smoke test's stand-ins for its CUDA-only allocations.
"""
from __future__ import annotations

import contextlib
import io
import sys
import time



def ref_prompt(ex: dict) -> str:
    """megatron_mmlu's zero-shot prompt (its _generate_prompt / _format_example, verbatim logic)."""
    p = "The following are multiple choice questions (with answers) about {}.\n\n".format(
        " ".join(ex["subject"].split("_")))
    q = ex["question"]
    for c, a in zip("ABCD", ex["choices"]):
        q += f"\n{c}. {a}"
    return p + q + "\nAnswer:"


def ref_selection(rows: list[dict], fraction: float) -> list[int]:
    counts: dict = {}
    for r in rows:
        counts[r["subject"]] = counts.get(r["subject"], 0) + 1
    seen: dict = {}
    out = []
    for i, r in enumerate(rows):
        k = seen.get(r["subject"], 0)
        if k >= fraction * counts[r["subject"]]:
            continue
        seen[r["subject"]] = k + 1
        out.append(i)
    return out


def reference_module():
    """The module modelopt.torch.utils.plugins.megatron_mmlu (its package re-exports a function of
    the same name, so ``import ... as`` would give the function)."""
    import importlib

    importlib.import_module("modelopt.torch.utils.plugins.megatron_mmlu")
    return sys.modules["modelopt.torch.utils.plugins.megatron_mmlu"]


class _TorchShim:
    """CPU smoke only: megatron_mmlu allocates its counters with device="cuda"."""

    def __init__(self, torch):
        self._torch = torch

    def __getattr__(self, name):
        return getattr(self._torch, name)

    def zeros(self, *a, **k):
        k.pop("device", None)
        return self._torch.zeros(*a, **k)


@contextlib.contextmanager
def cpu_reference_shims(enabled: bool):
    if not enabled:
        yield
        return
    import torch
    from megatron.core.inference import communication_utils as cu

    mm = reference_module()

    saved = (torch.Tensor.cuda, mm.torch, cu._is_cuda)
    torch.Tensor.cuda = lambda self, *a, **k: self
    mm.torch = _TorchShim(torch)
    cu._is_cuda = lambda t: None
    try:
        yield
    finally:
        torch.Tensor.cuda, mm.torch, cu._is_cuda = saved


def reference_view(model):
    """The same model object, returning bf16 logits as megatron_mmlu expects of a bf16 model."""
    from megatron.core.transformer.module import Float16Module, MegatronModule

    from launcher.megatron.models import unwrap_model

    class RefView(MegatronModule):
        def __init__(self, inner):
            super().__init__(config=inner.config)
            self.inner = inner
            self.vocab_size = unwrap_model(inner).vocab_size

        def forward(self, *args, **kwargs):
            if isinstance(self.inner, Float16Module):
                kwargs["fp32_output"] = False
            return self.inner(*args, **kwargs)

    return RefView(model)


def run_reference(model, tokenizer, fraction: float, batch_size: int, choice_ids, sync, cpu: bool,
                  dataset_dir: str) -> dict:
    import torch

    mm = reference_module()
    rec = {"t0": None, "t1": None, "calls": 0, "choice": [], "shapes": []}
    orig = mm.megatron_prefill
    choice = torch.tensor(list(choice_ids))

    def recording_prefill(m, ids, *a, **k):
        if rec["t0"] is None:
            sync()
            rec["t0"] = time.perf_counter()
        out = orig(m, ids, *a, **k)
        rec["choice"].append(out[:, :, choice.to(out.device)])
        rec["shapes"].append(tuple(ids.shape))
        sync()
        rec["t1"] = time.perf_counter()
        rec["calls"] += 1
        return out

    view = reference_view(model)
    mm.megatron_prefill = recording_prefill
    buf_out, buf_err = io.StringIO(), io.StringIO()
    try:
        with cpu_reference_shims(cpu), contextlib.redirect_stdout(buf_out), contextlib.redirect_stderr(buf_err):
            sync()
            t = time.perf_counter()
            acc = mm.megatron_mmlu(view, tokenizer, few_shots=0, fraction=fraction,
                                   batch_size=batch_size, mmlu_dataset=dataset_dir)
            sync()
            total = time.perf_counter() - t
    finally:
        mm.megatron_prefill = orig
    return {"accuracy": acc, "total_s": total, "loop_s": rec["t1"] - rec["t0"], "calls": rec["calls"],
            "choice": [c.float().cpu() for c in rec["choice"]], "shapes": rec["shapes"]}
