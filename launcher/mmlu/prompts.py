"""MMLU prompts exactly as lm-evaluation-harness renders them (tasks/mmlu/default), pure Python.

    The following are multiple choice questions (with answers) about abstract algebra.\\n\\n
    <shot 1>{question.strip()}\\nA. {c0}\\nB. {c1}\\nC. {c2}\\nD. {c3}\\nAnswer: {letter}\\n\\n
    ...
    {question.strip()}\\nA. {c0}\\nB. {c1}\\nC. {c2}\\nD. {c3}\\nAnswer:

Shots are the first ``k`` dev questions of the same subject, in dataset order (lm-eval's
``first_n`` sampler).  Choices are not stripped (lm-eval does not).  Scoring: the logits of the
last token of `` A`` .. `` D`` at the prompt's last token; argmax is the prediction.

BOS: ``add_bos=None`` is lm-eval's default for HF models (``add_bos_token=False``): no BOS.
``True`` prepends the tokenizer's BOS id (error when it has none); ``False``: no BOS.

``fraction`` (``select_fraction``): per subject, the first ``ceil(fraction * n)`` questions in
dataset order (at least one per subject) - deterministic and prefix-stable (raising the fraction
only adds questions).  ``seed`` instead takes a seeded random sample of that size per subject,
returned in dataset order.
"""
from __future__ import annotations

import math
import random
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional, Sequence

from launcher.mmlu.data import LETTERS, Question


@dataclass(frozen=True)
class Prompt:
    question: Question
    text: str


def description(subject: str) -> str:
    return ("The following are multiple choice questions (with answers) about "
            f"{subject.replace('_', ' ')}.\n\n")


def render_question(q: Question) -> str:
    lines = [q.question.strip()]
    lines += [f"{letter}. {choice}" for letter, choice in zip(LETTERS, q.choices)]
    return "\n".join(lines) + "\nAnswer:"


def render_shot(q: Question) -> str:
    return f"{render_question(q)} {LETTERS[q.answer]}\n\n"


def by_subject(questions: Sequence[Question]) -> "OrderedDict[str, list[Question]]":
    out: OrderedDict[str, list[Question]] = OrderedDict()
    for q in questions:
        out.setdefault(q.subject, []).append(q)
    return out


def build_prompt(q: Question, shots: Sequence[Question] = ()) -> str:
    return description(q.subject) + "".join(render_shot(s) for s in shots) + render_question(q)


def build_prompts(questions: Sequence[Question], dev: Sequence[Question] = (),
                  few_shots: int = 0) -> list[Prompt]:
    if not isinstance(few_shots, int) or few_shots < 0:
        raise ValueError(f"stages.mmlu.few_shots={few_shots!r}: must be an integer >= 0")
    dev_by_subject = by_subject(dev)
    out = []
    for q in questions:
        shots: list[Question] = []
        if few_shots:
            pool = dev_by_subject.get(q.subject, [])
            if len(pool) < few_shots:
                raise ValueError(f"stages.mmlu.few_shots={few_shots}: the dev split has only "
                                 f"{len(pool)} question(s) for subject {q.subject!r}")
            shots = pool[:few_shots]
        out.append(Prompt(q, build_prompt(q, shots)))
    return out


def select_fraction(questions: Sequence[Question], fraction: float,
                    seed: Optional[int] = None) -> list[Question]:
    """Per subject: ceil(fraction * n) questions (>= 1), the first ones or a seeded sample."""
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
        raise ValueError(f"stages.mmlu.fraction={fraction!r}: must be in (0, 1]")
    out: list[Question] = []
    for subject, qs in by_subject(questions).items():
        k = max(1, math.ceil(fraction * len(qs) - 1e-9))
        if seed is None:
            out.extend(qs[:k])
        else:
            rng = random.Random(f"{seed}:{subject}")
            out.extend(sorted(rng.sample(qs, k), key=lambda q: q.index))
    return out


# --- tokenizer side (duck-typed: encode(text, add_special_tokens=...); fast ones are batched) ----

def choice_token_ids(tokenizer) -> list[int]:
    """Last token of the encoding of " A" .. " D" (lm-eval's continuation " X")."""
    ids = []
    for letter in LETTERS:
        enc = tokenizer.encode(f" {letter}", add_special_tokens=False)
        if not enc:
            raise ValueError(f"tokenizer encodes ' {letter}' to no tokens")
        ids.append(int(enc[-1]))
    if len(set(ids)) != 4:
        raise ValueError(f"tokenizer maps ' A'..' D' to non-distinct ids {ids}")
    return ids


def encode_texts(tokenizer, texts: Sequence[str]) -> list[list[int]]:
    """Token ids of each text without special tokens, in one batched call when the tokenizer is
    a fast (Rust) one - the same ids as ``tokenizer.encode(text, add_special_tokens=False)``
    text by text (tests/test_mmlu_tokens.py checks it), several times faster."""
    texts = list(texts)
    if not texts:
        return []
    if getattr(tokenizer, "is_fast", False):
        enc = tokenizer(texts, add_special_tokens=False, return_attention_mask=False,
                        return_token_type_ids=False)["input_ids"]
        return [list(map(int, ids)) for ids in enc]
    return [[int(t) for t in tokenizer.encode(text, add_special_tokens=False)] for text in texts]


def bos_id(tokenizer, add_bos: Optional[bool]) -> Optional[int]:
    """The BOS id to prepend (``add_bos`` true), None otherwise; error when there is none."""
    if not add_bos:
        return None
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        raise ValueError("stages.mmlu.add_bos=true but the tokenizer has no BOS token; "
                         "valid: null (lm-eval default: no BOS) or false")
    return int(bos)


def finish_ids(raw: Sequence[Sequence[int]], bos: Optional[int] = None,
               max_seq_len: Optional[int] = None) -> tuple[list[list[int]], int]:
    """Prepend ``bos`` and left-truncate to ``max_seq_len`` (as lm-eval does: the end of the
    prompt, where the answer is scored, is kept); returns the ids and how many were truncated."""
    out, truncated = [], 0
    for ids in raw:
        ids = list(ids) if bos is None else [bos, *ids]
        if max_seq_len and len(ids) > max_seq_len:
            ids = ids[-max_seq_len:]
            truncated += 1
        out.append(ids)
    return out, truncated


def encode_prompts(prompts: Sequence[Prompt], tokenizer, add_bos: Optional[bool] = None,
                   max_seq_len: Optional[int] = None) -> tuple[list[list[int]], int]:
    """Token ids per prompt and the number of prompts left-truncated to ``max_seq_len``."""
    bos = bos_id(tokenizer, add_bos)
    return finish_ids(encode_texts(tokenizer, [p.text for p in prompts]), bos, max_seq_len)
