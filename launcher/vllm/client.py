"""A minimal OpenAI-compatible client for vLLM's server (stdlib urllib only)."""
from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any, Optional, Sequence


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


def complete(base_url: str, model: str, prompts: Sequence[str], max_tokens: int,
             timeout: float = 300.0) -> list[str]:
    """Greedy completions (temperature 0) for ``prompts``, in order; one batched request."""
    payload = {"model": model, "prompt": list(prompts), "max_tokens": int(max_tokens),
               "temperature": 0.0, "top_p": 1.0, "n": 1, "seed": 0}
    data = _request(f"{base_url}/v1/completions", payload, timeout=timeout)
    choices = data.get("choices") or []
    if len(choices) != len(prompts):
        raise ClientError(f"/v1/completions returned {len(choices)} choices for {len(prompts)} prompts")
    texts = [""] * len(prompts)
    for c in choices:
        texts[int(c["index"])] = c.get("text") or ""
    return texts
