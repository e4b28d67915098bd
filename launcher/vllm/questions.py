"""The smoke questions and how an answer is scored (pure Python).

Two sources:
  * MMLU (default): ``n`` questions of ``stages.mmlu.dataset``'s test split, evenly spaced over
    the split (deterministic, spans the subjects), as zero-shot lm-eval prompts ending
    "Answer:"; the answer is the first standalone letter A-D of the completion.
  * a jsonl of ``{"prompt": ..., "expected": ...}`` or ``{"prompt": ..., "contains": ...}``:
    ``expected`` one of A-D is scored like MMLU; any other ``expected`` must be a prefix of the
    stripped completion; ``contains`` must occur in it (case-insensitive).  A row with neither
    is asked but not scored (only "non-empty" applies).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Optional, Sequence

LETTERS = ("A", "B", "C", "D")
_LETTER = re.compile(r"\b([ABCD])\b")


@dataclass(frozen=True)
class SmokeQuestion:
    id: str
    prompt: str
    expected: Optional[str] = None      # a letter (MMLU) or a prefix
    contains: Optional[str] = None
    subject: Optional[str] = None

    @property
    def scored(self) -> bool:
        return self.expected is not None or self.contains is not None


def first_letter(text: str) -> Optional[str]:
    """The first standalone A-D of a completion (" B\\n\\nQuestion" -> "B"; "Answer: C" -> "C")."""
    m = _LETTER.search(text or "")
    return m.group(1) if m else None


def score(q: SmokeQuestion, response: str) -> tuple[Optional[bool], Optional[str]]:
    """(correct or None when unscored, the predicted answer)."""
    text = (response or "").strip()
    if q.expected is not None:
        exp = q.expected.strip()
        if exp in LETTERS:
            pred = first_letter(text)
            return pred == exp, pred
        return text.startswith(exp), text[:len(exp)]
    if q.contains is not None:
        return q.contains.lower() in text.lower(), None
    return None, None


def spaced(total: int, n: int) -> list[int]:
    """``n`` indices spread evenly over ``range(total)`` (all of them when n >= total)."""
    if n >= total:
        return list(range(total))
    return [(i * total) // n for i in range(n)]


def mmlu_questions(dataset: str, n: int) -> list[SmokeQuestion]:
    """``n`` zero-shot MMLU questions with known answers (launcher.mmlu renders the prompts)."""
    from launcher.mmlu.data import load_mmlu
    from launcher.mmlu.prompts import build_prompt

    if n < 1:
        raise ValueError(f"stages.vllm_smoke.questions={n}: must be >= 1")
    qs = load_mmlu(dataset, "test")
    if not qs:
        raise ValueError(f"stages.mmlu.dataset={dataset!r}: no test questions")
    return [SmokeQuestion(id=f"mmlu/{qs[i].subject}/{qs[i].index}", prompt=build_prompt(qs[i]),
                          expected=LETTERS[qs[i].answer], subject=qs[i].subject)
            for i in spaced(len(qs), n)]


def jsonl_questions(path: str) -> list[SmokeQuestion]:
    out = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"stages.vllm_smoke.prompts={path}:{lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not JSON ({e})") from e
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"]:
                raise ValueError(f"{where}: expected an object with a non-empty string 'prompt'")
            exp, con = row.get("expected"), row.get("contains")
            for key, val in (("expected", exp), ("contains", con)):
                if val is not None and (not isinstance(val, str) or not val.strip()):
                    raise ValueError(f"{where}: {key!r} must be a non-empty string")
            if exp is not None and con is not None:
                raise ValueError(f"{where}: give 'expected' or 'contains', not both")
            out.append(SmokeQuestion(id=str(row.get("id", lineno)), prompt=row["prompt"],
                                     expected=exp, contains=con))
    if not out:
        raise ValueError(f"stages.vllm_smoke.prompts={path}: no prompts")
    return out


def summarize(questions: Sequence[SmokeQuestion], responses: Sequence[str]) -> dict:
    """Per-question records and the totals the pass criterion needs."""
    rows, n_correct, n_scored, empty = [], 0, 0, []
    for q, r in zip(questions, responses):
        correct, pred = score(q, r)
        if not (r or "").strip():
            empty.append(q.id)
        if correct is not None:
            n_scored += 1
            n_correct += int(correct)
        rows.append({"id": q.id, "subject": q.subject, "prompt": q.prompt, "response": r,
                     "expected": q.expected, "contains": q.contains, "predicted": pred,
                     "correct": correct})
    return {"questions": rows, "n": len(rows), "n_scored": n_scored, "n_correct": n_correct,
            "accuracy": (n_correct / n_scored) if n_scored else None, "empty_responses": empty}


def verdict(summary: dict, min_accuracy: float) -> list[str]:
    """Why the smoke test fails ([] = pass): any empty answer, or accuracy < min_accuracy.

    With nothing scored (a jsonl without expected/contains) only "non-empty" applies.
    """
    problems = []
    empty = summary["empty_responses"]
    if empty:
        problems.append(f"{len(empty)} empty answer(s): {', '.join(empty[:5])}")
    acc = summary["accuracy"]
    if acc is not None and acc < min_accuracy:
        problems.append(f"accuracy {acc:.3f} ({summary['n_correct']}/{summary['n_scored']}) < "
                        f"min_accuracy {min_accuracy:g}")
    return problems
