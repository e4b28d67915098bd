"""A minimal OpenAI-compatible client for vLLM's server (stdlib urllib only).

Prompts are token-id lists (``/v1/completions`` takes them as they are: no re-tokenization,
no BOS added).  Choice scoring (``choice_logprobs``), two ways, both measured to give the same
numbers on vLLM 0.32 CPU:
  * ``prompt_logprobs``: one request per (prompt, choice) with the choice token appended,
    ``prompt_logprobs=0`` (each prompt token's own log-probability): the last entry is
    log p(choice | prompt) - lm-eval's loglikelihood of the continuation.  (``echo`` with
    ``logprobs`` is the same thing in vLLM: the server maps it to prompt_logprobs.)
  * ``choice_logprobs``: one request per prompt, ``max_tokens=1``, ``logprob_token_ids`` = the
    four choice ids: their log-probabilities at the first generated position, i.e. at the
    prompt's end.
Both are log-softmax over the whole vocabulary of the raw logits (vLLM's default
``logprobs_mode=raw_logprobs``: before any sampling processor).
"""
from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any, Callable, Optional, Sequence

from launcher.schema import VLLM_SCORING as SCORING_METHODS

CHUNK = 64      # prompts per request (progress, bounded response size)


class ClientError(RuntimeError):
    pass


def _request(url: str, payload: Optional[dict] = None, timeout: float = 30.0) -> Any:
    data = None if payload is None else json.dumps(payload).encode()
    req = urllib.request.Request(url, data=data, method="GET" if data is None else "POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            body = resp.read().decode()
    except urllib.error.HTTPError as e:
        detail = e.read().decode(errors="replace")[:2000]
        raise ClientError(f"{url}: HTTP {e.code}: {detail}") from e
    except (urllib.error.URLError, OSError) as e:
        raise ClientError(f"{url}: {e}") from e
    return json.loads(body) if body else None


def healthy(base_url: str, timeout: float = 2.0) -> bool:
    """True once GET /health answers 200."""
    try:
        with urllib.request.urlopen(f"{base_url}/health", timeout=timeout) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def models(base_url: str, timeout: float = 10.0) -> list[str]:
    data = _request(f"{base_url}/v1/models", timeout=timeout)
    return [m["id"] for m in data.get("data", [])]


def _completions(base_url: str, model: str, prompts: Sequence[Sequence[int]], extra: dict,
                 timeout: float) -> list[dict]:
    """The choices of one /v1/completions request, in prompt order."""
    payload = {"model": model, "prompt": [list(p) for p in prompts], "temperature": 0.0,
               "top_p": 1.0, "n": 1, "seed": 0, **extra}
    data = _request(f"{base_url}/v1/completions", payload, timeout=timeout)
    choices = data.get("choices") or []
    if len(choices) != len(prompts):
        raise ClientError(f"/v1/completions returned {len(choices)} choices for {len(prompts)} prompts")
    out: list = [None] * len(prompts)
    for c in choices:
        out[int(c["index"])] = c
    return out


def _chunks(items: Sequence, size: int = CHUNK):
    for i in range(0, len(items), size):
        yield i, items[i:i + size]


def complete(base_url: str, model: str, prompts: Sequence[Sequence[int]], max_tokens: int,
             timeout: float = 300.0) -> list[str]:
    """Greedy completions (temperature 0) of token-id prompts, in order."""
    texts: list[str] = []
    for _, part in _chunks(prompts):
        texts += [c.get("text") or "" for c in
                  _completions(base_url, model, part, {"max_tokens": int(max_tokens)}, timeout)]
    return texts


def choice_logprobs(base_url: str, model: str, prompts: Sequence[Sequence[int]],
                    choice_ids: Sequence[int], method: str, timeout: float = 300.0,
                    progress: Optional[Callable[[int, int], None]] = None) -> list[list[float]]:
    """Per prompt: log p(choice | prompt) for each of ``choice_ids``, by ``method``."""
    if method not in SCORING_METHODS:
        raise ValueError(f"stages.vllm_smoke.scoring={method!r}: valid: {', '.join(SCORING_METHODS)}")
    out: list[list[float]] = []
    per_chunk = max(1, CHUNK // len(choice_ids)) if method == "prompt_logprobs" else CHUNK
    for start, part in _chunks(prompts, per_chunk):
        if method == "prompt_logprobs":
            reqs = [list(p) + [int(c)] for p in part for c in choice_ids]
            got = _completions(base_url, model, reqs, {"max_tokens": 1, "prompt_logprobs": 0}, timeout)
            k = len(choice_ids)
            for i in range(len(part)):
                row = []
                for j, cid in enumerate(choice_ids):
                    last = (got[i * k + j].get("prompt_logprobs") or [None])[-1]
                    if not last or str(cid) not in last:
                        raise ClientError(f"/v1/completions: no prompt logprob for choice token {cid}")
                    row.append(float(last[str(cid)]["logprob"]))
                out.append(row)
        else:
            got = _completions(base_url, model, part,
                               {"max_tokens": 1, "logprobs": len(choice_ids),
                                "logprob_token_ids": [int(c) for c in choice_ids],
                                "return_tokens_as_token_ids": True}, timeout)
            for c in got:
                top = ((c.get("logprobs") or {}).get("top_logprobs") or [None])[0] or {}
                try:
                    out.append([float(top[f"token_id:{int(cid)}"]) for cid in choice_ids])
                except KeyError as e:
                    raise ClientError(f"/v1/completions: no logprob for choice token {e} in {sorted(top)}") from e
        if progress is not None:
            progress(min(start + len(part), len(prompts)), len(prompts))
    return out
