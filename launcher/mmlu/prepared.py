"""The gate's questions, ready to evaluate: prompts -> token ids -> length-sorted batches.

Pure Python given a tokenizer; the mmlu stage, the vLLM smoke (the same questions, for its
agreement check) and the benchmarks all prepare their questions here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from launcher.contract import StageFailed
from launcher.mmlu.batching import Batch, BatchLimits, make_batches_for, resolve_limits
from launcher.mmlu.prompts import Prompt, bos_id, choice_token_ids, finish_ids
from launcher.mmlu.token_cache import prompts_and_ids


@dataclass
class Prepared:
    prompts: list[Prompt]
    token_ids: list[list[int]]
    batches: list[Batch]
    choice_ids: list[int]
    pad_id: int
    truncated: int
    limits: Optional[BatchLimits] = None
    token_cache: Optional[dict] = None


def load_tokenizer(path: str, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)


def pad_token_id(tokenizer) -> int:
    for attr in ("pad_token_id", "eos_token_id"):
        v = getattr(tokenizer, attr, None)
        if v is not None:
            return int(v)
    return 0


def prepare(scfg, tokenizer, limits: Optional[BatchLimits] = None,
            cache_root: Optional[str] = None) -> Prepared:
    """Questions -> prompts -> token ids -> batches (pure Python given a tokenizer).

    ``limits``: the resolved batch limits (``batch_limits``); default: ``batch_size`` /
    ``max_batch_tokens`` resolved for CPU.  ``cache_root``: where the prompts and token ids are
    cached (``launcher.mmlu.token_cache``); None: no cache.
    """
    prompts, raw_ids, cache_info = prompts_and_ids(scfg.dataset, scfg.dev_dataset, scfg.fraction,
                                                   scfg.few_shots, tokenizer, cache_root)
    if not prompts:
        raise StageFailed(f"stages.mmlu.dataset={scfg.dataset!r} holds no test questions")
    token_ids, truncated = finish_ids(raw_ids, bos_id(tokenizer, scfg.add_bos), scfg.max_seq_len)
    if limits is None:
        limits = resolve_limits(scfg.batch_size, scfg.max_batch_tokens, "cpu")
    batches = make_batches_for([len(t) for t in token_ids], limits)
    return Prepared(prompts, token_ids, batches, choice_token_ids(tokenizer), pad_token_id(tokenizer),
                    truncated, limits, cache_info)
