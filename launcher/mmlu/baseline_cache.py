"""Cached per-question baseline results, so that a nightly gate evaluates the baseline once per change.

``stages.mmlu.baseline: evaluate`` evaluates the unquantized checkpoint on the gate's questions,
or reuses a cache entry with the same key; ``baseline: cached`` requires the entry (the stage
fails naming what differs from the nearest entries when there is none).  An entry is
``<dir>/<key>.json`` (``dir``: ``stages.mmlu.baseline_cache_dir``, default
``<cache_dir()>/mmlu_baseline``) holding, in prompt order, each question's predicted choice and
its four choice logits exactly as evaluated (JSON floats round-trip exactly).

The key is the sha256 of these fields (``key_fields``), nothing else:

* ``checkpoint_sha256``: the content of the files the evaluation reads from ``model.path``
  (config.json, weights, safetensors index, tokenizer files; ``checkpoint_files``), not its path
  or mtime.  Per-file digests are memoized in ``<dir>/file_hashes.json`` by (path, size, mtime),
  so an unchanged multi-GB checkpoint is not re-read every night;
* ``prompts_sha256`` and ``tokens_sha256``: the rendered prompts (questions, shots) and their
  token ids (tokenizer, add_bos, truncation), in order; ``n_questions``;
* ``few_shots``, ``add_bos``, ``dtype`` (the dtype the model runs in: float32 on CPU);
* ``evaluator``: ``EVALUATOR_VERSION``, bumped when scoring changes.

The parallel layout is not part of the key: the same weights at another TP/PP give the same
predictions up to fp32 summation order.  Pure Python (hashlib, json): validation imports it.
"""
from __future__ import annotations

import fnmatch
import hashlib
import json
import os
from dataclasses import dataclass, field
from typing import Optional, Sequence

EVALUATOR_VERSION = "mmlu-logits-1"
FILE_HASHES = "file_hashes.json"
CHECKPOINT_PATTERNS = ("config.json", "*.safetensors", "*.safetensors.index.json", "*.bin", "*.bin.index.json",
                       "tokenizer*", "vocab*", "merges.txt", "special_tokens_map.json", "added_tokens.json",
                       "chat_template*", "*.model", "*.tiktoken")
_KEY_FIELDS = ("checkpoint_sha256", "prompts_sha256", "tokens_sha256", "n_questions", "few_shots", "add_bos",
               "dtype", "evaluator")


def default_dir() -> str:
    from launcher.paths import cache_dir

    return os.path.join(cache_dir(), "mmlu_baseline")


def resolve_dir(configured: Optional[str]) -> str:
    return os.path.abspath(configured) if configured else default_dir()


def checkpoint_files(model_path: str) -> list[str]:
    """The file names in ``model_path`` that the evaluation reads (sorted)."""
    names = []
    for name in sorted(os.listdir(model_path)):
        if os.path.isfile(os.path.join(model_path, name)) and any(fnmatch.fnmatch(name, p) for p in CHECKPOINT_PATTERNS):
            names.append(name)
    return names


def _file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _read_json(path: str) -> Optional[dict]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def checkpoint_digest(model_path: str, memo_dir: Optional[str] = None) -> str:
    """sha256 over (name, sha256 of content) of ``checkpoint_files``; memoized per file in memo_dir."""
    names = checkpoint_files(model_path)
    if "config.json" not in names:
        raise ValueError(f"model.path={model_path!r} has no config.json")
    memo_path = os.path.join(memo_dir, FILE_HASHES) if memo_dir else None
    memo = (_read_json(memo_path) or {}) if memo_path else {}
    changed = False
    h = hashlib.sha256()
    for name in names:
        path = os.path.realpath(os.path.join(model_path, name))
        st = os.stat(path)
        stamp = f"{st.st_size}:{st.st_mtime_ns}"
        entry = memo.get(path)
        if not (isinstance(entry, dict) and entry.get("stamp") == stamp):
            entry = {"stamp": stamp, "sha256": _file_sha256(path)}
            memo[path] = entry
            changed = True
        h.update(f"{name}\0{entry['sha256']}\n".encode())
    if memo_path and changed:
        from launcher.contract import write_json_atomic

        os.makedirs(memo_dir, exist_ok=True)
        write_json_atomic(memo_path, memo)
    return h.hexdigest()


def _sha256_lines(items) -> str:
    h = hashlib.sha256()
    for item in items:
        h.update(item.encode() if isinstance(item, str) else json.dumps(item).encode())
        h.update(b"\n")
    return h.hexdigest()


def key_fields(checkpoint_sha256: str, prompt_texts: Sequence[str], token_ids: Sequence[Sequence[int]],
               few_shots: int, add_bos: Optional[bool], dtype: str) -> dict:
    return {"checkpoint_sha256": checkpoint_sha256, "prompts_sha256": _sha256_lines(prompt_texts),
            "tokens_sha256": _sha256_lines([list(map(int, t)) for t in token_ids]),
            "n_questions": len(prompt_texts), "few_shots": int(few_shots), "add_bos": add_bos, "dtype": str(dtype),
            "evaluator": EVALUATOR_VERSION}


def cache_key(fields: dict) -> str:
    return hashlib.sha256(json.dumps({k: fields[k] for k in _KEY_FIELDS}, sort_keys=True).encode()).hexdigest()[:24]


@dataclass
class Lookup:
    directory: str
    key: str
    fields: dict
    path: str
    results: Optional[dict] = None          # prompt index -> (prediction, [4 logits]) on a hit
    miss_reason: str = ""
    entry: dict = field(default_factory=dict)

    @property
    def hit(self) -> bool:
        return self.results is not None


def entries(directory: str) -> list[dict]:
    """Every readable entry in ``directory`` (without their results), oldest first."""
    if not os.path.isdir(directory):
        return []
    out = []
    for name in sorted(os.listdir(directory)):
        if name.endswith(".json") and name != FILE_HASHES:
            doc = _read_json(os.path.join(directory, name))
            if doc and isinstance(doc.get("fields"), dict) and isinstance(doc.get("results"), list):
                out.append({k: v for k, v in doc.items() if k != "results"} | {"path": os.path.join(directory, name)})
    return sorted(out, key=lambda e: e.get("created_unix", 0))


def entries_for_model(directory: str, model_path: str) -> list[dict]:
    real = os.path.realpath(model_path)
    return [e for e in entries(directory) if os.path.realpath(str(e.get("model_path", ""))) == real]


def _explain_miss(directory: str, fields: dict, model_path: str) -> str:
    same_ckpt = [e for e in entries(directory) if e["fields"].get("checkpoint_sha256") == fields["checkpoint_sha256"]]
    candidates = same_ckpt or entries_for_model(directory, model_path)
    if not candidates:
        return (f"no cached baseline in {directory} for this checkpoint (model.path={model_path}, content sha256 "
                f"{fields['checkpoint_sha256'][:16]}...); run once with stages.mmlu.baseline=evaluate")
    lines = []
    for e in candidates[-3:]:
        diff = [f"{k}: cached {e['fields'].get(k)!r} vs now {fields[k]!r}" for k in _KEY_FIELDS
                if e["fields"].get(k) != fields[k]]
        lines.append(f"{os.path.basename(e['path'])} differs in " + "; ".join(diff))
    what = "this checkpoint" if same_ckpt else f"model.path={model_path} (whose content changed since)"
    return (f"no cached baseline in {directory} matches: entries for {what} exist but " + " | ".join(lines)
            + "; run with stages.mmlu.baseline=evaluate to add one")


def lookup(directory: str, model_path: str, prompt_texts: Sequence[str], token_ids: Sequence[Sequence[int]],
           few_shots: int, add_bos: Optional[bool], dtype: str) -> Lookup:
    fields = key_fields(checkpoint_digest(model_path, directory), prompt_texts, token_ids, few_shots, add_bos, dtype)
    key = cache_key(fields)
    path = os.path.join(directory, f"{key}.json")
    doc = _read_json(path)
    if doc is None:
        return Lookup(directory, key, fields, path, miss_reason=_explain_miss(directory, fields, model_path))
    rows = doc.get("results")
    if doc.get("fields") != fields or not isinstance(rows, list) or len(rows) != fields["n_questions"]:
        return Lookup(directory, key, fields, path, miss_reason=f"{path} is not a valid entry for this key")
    results = {i: (int(pred), [float(x) for x in logits]) for i, (pred, logits) in enumerate(rows)}
    return Lookup(directory, key, fields, path, results=results,
                  entry={k: v for k, v in doc.items() if k != "results"})


def store(found: Lookup, results: dict, model_path: str, accuracy: float, layout) -> str:
    """Write ``results`` (prompt index -> (prediction, logits)) as the entry of ``found.key``."""
    import time

    from launcher.contract import write_json_atomic

    n = found.fields["n_questions"]
    if sorted(results) != list(range(n)):
        raise ValueError(f"baseline results cover {len(results)} prompts, the key says {n}")
    os.makedirs(found.directory, exist_ok=True)
    write_json_atomic(found.path, {
        "key": found.key, "fields": found.fields, "model_path": os.path.abspath(model_path),
        "accuracy": accuracy, "layout": layout, "created_unix": int(time.time()),
        "results": [[int(results[i][0]), [float(x) for x in results[i][1]]] for i in range(n)]})
    return found.path
