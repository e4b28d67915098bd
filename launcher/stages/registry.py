"""The ``Stage`` protocol and the registry of the pipeline's stages (no torch at import).

The worker asks ``get(name)`` for the stage it runs (``needs_megatron`` says whether its ranks
start torch.distributed + Megatron-Core first); the pipeline asks it what a finished stage
wrote (``skip_reason``, ``summary``).  Every stage module is imported only when it runs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Protocol

from launcher.contract import STAGE_ORDER, RunLayout, StageName
from launcher.rundir import read_json


class Stage(Protocol):
    name: str
    needs_megatron: bool

    def run(self, ctx) -> None:
        """The stage's work on one rank (raises StageFailed to fail with an exit code)."""

    def summary(self, layout: RunLayout) -> Optional[str]:
        """One line for the pipeline's final summary, or None."""

    def skip_reason(self, layout: RunLayout) -> Optional[str]:
        """Why the stage decided not to do its work (its skip.json), or None if it did."""


@dataclass(frozen=True)
class RegisteredStage:
    name: str
    needs_megatron: bool
    runner: Callable[[object], None]
    summarize: Optional[Callable[[RunLayout], Optional[str]]] = None

    def run(self, ctx) -> None:
        self.runner(ctx)

    def summary(self, layout: RunLayout) -> Optional[str]:
        return self.summarize(layout) if self.summarize else None

    def skip_reason(self, layout: RunLayout) -> Optional[str]:
        skip = read_json(layout.skip(self.name))
        return skip.get("reason", "") if skip else None


def _quantize(ctx) -> None:
    from launcher.stages import quantize

    quantize.run(ctx)


def _mmlu(ctx) -> None:
    from launcher.stages import mmlu

    mmlu.run(ctx)


def _export(ctx) -> None:
    from launcher.stages import export

    export.run(ctx)


def _vllm_smoke(ctx) -> None:
    from launcher.stages import vllm_smoke

    vllm_smoke.run(ctx)


def _mmlu_summary(layout: RunLayout) -> Optional[str]:
    results = read_json(layout.mmlu_results)
    if not results:
        return None
    return (f"mmlu accuracy {results.get('accuracy')} (n={results.get('n')}, "
            f"bound {results.get('lower_bound')}, pass={results.get('pass')})")


STAGES: dict[str, Stage] = {s.name: s for s in (
    RegisteredStage(StageName.QUANTIZE, needs_megatron=True, runner=_quantize),
    RegisteredStage(StageName.MMLU, needs_megatron=True, runner=_mmlu, summarize=_mmlu_summary),
    RegisteredStage(StageName.EXPORT, needs_megatron=True, runner=_export),
    RegisteredStage(StageName.VLLM_SMOKE, needs_megatron=False, runner=_vllm_smoke),   # vLLM runs out of process
)}
assert list(STAGES) == list(STAGE_ORDER), "the registry lists every stage, in pipeline order"


def get(name: str) -> Stage:
    try:
        return STAGES[name]
    except KeyError:
        raise ValueError(f"unknown stage {name!r}; valid: {', '.join(STAGES)}") from None
