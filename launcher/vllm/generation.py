"""Generation checks: prompts whose greedy continuation must contain (or start with) a string.

The jsonl (``stages.vllm_smoke.prompts``), one object a line::

    {"prompt": "The capital of France is", "contains": "Paris"}
    {"prompt": "2 + 2 =", "expected": "4", "id": "sum", "chat": false}

``contains``: must occur in the completion (case-insensitive); ``expected``: the stripped
completion must start with it; neither: only "non-empty" applies.  ``chat`` (default: true when
the served tokenizer has a chat template) renders the prompt as one user turn with the template
and the generation prompt; otherwise the prompt is encoded as the tokenizer does by default
(its special tokens, e.g. a BOS, included).  Token ids go to vLLM as they are, so server and
offline mode see the same input, and responses.json records the rendered text.

Pass rule (separate from the choice check): every answer is non-empty and every check holds.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Optional, Sequence


@dataclass(frozen=True)
class GenerationCheck:
    id: str
    prompt: str
    contains: Optional[str] = None
    expected: Optional[str] = None      # a prefix of the stripped completion
    chat: Optional[bool] = None         # None: when the tokenizer has a chat template


def read_checks(path: str) -> list[GenerationCheck]:
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
            unknown = sorted(set(row) - {"prompt", "contains", "expected", "id", "chat"})
            if unknown:
                raise ValueError(f"{where}: unknown key(s) {unknown}; valid: prompt, contains, "
                                 f"expected, id, chat")
            exp, con = row.get("expected"), row.get("contains")
            for key, val in (("expected", exp), ("contains", con)):
                if val is not None and (not isinstance(val, str) or not val.strip()):
                    raise ValueError(f"{where}: {key!r} must be a non-empty string")
            if exp is not None and con is not None:
                raise ValueError(f"{where}: give 'expected' or 'contains', not both")
            chat = row.get("chat")
            if chat is not None and not isinstance(chat, bool):
                raise ValueError(f"{where}: 'chat' must be true or false, got {chat!r}")
            out.append(GenerationCheck(id=str(row.get("id", lineno)), prompt=row["prompt"],
                                       contains=con, expected=exp, chat=chat))
    if not out:
        raise ValueError(f"stages.vllm_smoke.prompts={path}: no prompts")
    return out


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def render(check: GenerationCheck, tokenizer) -> tuple[list[int], str, bool]:
    """(token ids, the text they encode, whether the chat template was applied)."""
    use_chat = has_chat_template(tokenizer) if check.chat is None else check.chat
    if use_chat:
        if not has_chat_template(tokenizer):
            raise ValueError(f"generation check {check.id}: chat=true but the tokenizer has no chat template")
        text = tokenizer.apply_chat_template([{"role": "user", "content": check.prompt}],
                                             tokenize=False, add_generation_prompt=True)
        ids = tokenizer.encode(text, add_special_tokens=False)   # the template carries its specials
    else:
        ids = tokenizer.encode(check.prompt)
        text = tokenizer.decode(ids)
    return [int(t) for t in ids], text, use_chat


def judge(check: GenerationCheck, response: str) -> Optional[bool]:
    """True/False for a check with ``contains``/``expected``; None for an unscored prompt."""
    text = (response or "").strip()
    if check.contains is not None:
        return check.contains.lower() in text.lower()
    if check.expected is not None:
        return text.startswith(check.expected.strip())
    return None


def summarize(checks: Sequence[GenerationCheck], rendered: Sequence[str], chat: Sequence[bool],
              responses: Sequence[str]) -> dict:
    rows = []
    for c, text, used_chat, r in zip(checks, rendered, chat, responses):
        rows.append({**asdict(c), "chat": used_chat, "rendered": text, "response": r,
                     "passed": judge(c, r)})
    scored = [r for r in rows if r["passed"] is not None]
    return {"n": len(rows), "n_scored": len(scored), "n_passed": sum(bool(r["passed"]) for r in scored),
            "empty_responses": [r["id"] for r in rows if not (r["response"] or "").strip()],
            "failed": [r["id"] for r in scored if not r["passed"]], "prompts": rows}


def verdict(summary: dict) -> list[str]:
    """Why the generation checks fail ([] = pass): an empty answer, or a check that does not hold."""
    problems = []
    if summary["empty_responses"]:
        e = summary["empty_responses"]
        problems.append(f"{len(e)} empty generation(s): {', '.join(e[:5])}")
    if summary["failed"]:
        bad = {r["id"]: r for r in summary["prompts"]}
        parts = [f"{i} (wanted {bad[i]['contains'] or bad[i]['expected']!r}, got {bad[i]['response'][:60]!r})"
                 for i in summary["failed"][:3]]
        problems.append(f"generation checks {summary['n_passed']}/{summary['n_scored']} passed; "
                        f"failed: {'; '.join(parts)}")
    return problems
