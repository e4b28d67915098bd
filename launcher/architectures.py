"""The one table of supported Hugging Face architectures (no torch): what each is, end to end.

A model card's ``architecture`` is config.json's ``architectures[0]``.  For each supported one the
table says
  * ``builder``: which Megatron-Core model ``launcher.megatron.models`` builds for it: ``"gpt"``
    (``GPTModel``, local layer spec) or ``"hybrid"`` (``HybridModel``: Mamba-2 + attention + MoE,
    ``launcher.megatron.hybrid_spec``);
  * ``max_tp``: the largest tensor-parallel degree a stage may use (None: any that divides the
    attention heads and query groups), and ``tp_reason``, why;
  * ``dtypes``: the parameter dtypes it is built in on CUDA (``contract.Dtype``; CPU runs float32);
  * ``dispatchers``: the MoE token dispatchers it is built with (``contract.Dispatcher``);
  * ``gpu_only``: None when it runs on a CPU machine too (the hybrid one does: Mamba's reference
    kernels, ``launcher.megatron.cpu_compat``), otherwise why it needs CUDA.

Used by config validation and card derivation, the Megatron model builder, the rank's start
(the hybrid patch) and ``launch suite`` (what this machine can run).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from launcher.contract import Dispatcher, Dtype, values

BUILDERS = ("gpt", "hybrid")


@dataclass(frozen=True)
class Architecture:
    name: str
    builder: str                                   # one of BUILDERS
    max_tp: Optional[int] = None
    tp_reason: str = ""
    dtypes: tuple[str, ...] = values(Dtype)
    dispatchers: tuple[str, ...] = values(Dispatcher)
    gpu_only: Optional[str] = None

    @property
    def hybrid(self) -> bool:
        """Built as Megatron's hybrid (Mamba) model: its card has a layer pattern."""
        return self.builder == "hybrid"


_NEMOTRON_H_TP = ("ModelOpt 0.47's Nemotron-H import replicates the Mamba mixer's norm weight, which Megatron "
                  "shards over TP (the weights would not load); use ep/pp instead")

ARCHITECTURES: dict[str, Architecture] = {a.name: a for a in (
    Architecture("Qwen3MoeForCausalLM", builder="gpt"),
    Architecture("Qwen3ForCausalLM", builder="gpt"),
    Architecture("LlamaForCausalLM", builder="gpt"),
    Architecture("NemotronHForCausalLM", builder="hybrid", max_tp=1, tp_reason=_NEMOTRON_H_TP),
)}
SUPPORTED = tuple(ARCHITECTURES)
HYBRID = tuple(name for name, a in ARCHITECTURES.items() if a.hybrid)


def is_hybrid(name: object) -> bool:
    """True for a supported architecture built as Megatron's hybrid model."""
    a = ARCHITECTURES.get(name) if isinstance(name, str) else None
    return a is not None and a.hybrid


def architecture(name: object) -> Architecture:
    """The table's entry; ValueError naming the supported ones for any other name."""
    if not isinstance(name, str) or name not in ARCHITECTURES:
        raise ValueError(f"architecture {name!r} is not supported; supported: {list(SUPPORTED)}")
    return ARCHITECTURES[name]


def tp_problem(name: str, tp: int) -> Optional[str]:
    """Why ``tp`` is too large a tensor-parallel degree for architecture ``name``; None when it is not
    (or the architecture is not in the table: that is reported on its own)."""
    a = ARCHITECTURES.get(name)
    if a is None or a.max_tp is None or tp <= a.max_tp:
        return None
    return f"must be {'' if a.max_tp == 1 else 'at most '}{a.max_tp} for {name}: {a.tp_reason}"
