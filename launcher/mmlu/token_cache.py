"""Prompts and token ids of an MMLU selection, cached on disk so a rerun skips parsing and
tokenizing - pure Python (``array``, ``hashlib``, ``json``), no torch.

``prompts_and_ids(dataset, dev_dataset, fraction, few_shots, tokenizer, cache_root)`` returns the
selected questions' lm-eval prompts and their token ids (no BOS, not truncated: ``add_bos`` and
``max_seq_len`` are applied afterwards, by ``prompts.finish_ids``), and where they came from.

Key: sha256 of the dataset's identity (resolved path; relative name, size and mtime of every
file under it), the dev source's identity when ``few_shots > 0``, ``fraction``, ``few_shots`` and
the tokenizer's identity (class, vocabulary size, resolved ``name_or_path`` and the size and
mtime of its tokenizer files).  Any change to one of them is a new key, so an entry is never
stale; a source that is a hub id, or a tokenizer with no local files, is not cached.

Entry: ``<cache_root>/mmlu-tokens/<key>.bin`` - an 8-byte little-endian header length, a UTF-8
JSON header (the key's parts, each question as ``[index, subject, question, choices, answer]``,
each prompt's text, the offsets of its ids), then the ids as little-endian int32.  Written to a
temporary name and renamed (ranks racing to write the same entry each write a whole file); an
unreadable entry is rebuilt, and a failed write is reported in ``info`` but does not fail the stage.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
import sys
import time
from array import array
from typing import Optional, Sequence

from launcher.mmlu.data import Question, load_dev, load_mmlu, source_kind
from launcher.mmlu.prompts import Prompt, build_prompts, encode_texts, select_fraction

VERSION = 1
SUBDIR = "mmlu-tokens"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "added_tokens.json", "vocab.json", "merges.txt", "tokenizer.model", "vocab.txt")


def _file_ids(root: str) -> list:
    if os.path.isfile(root):
        st = os.stat(root)
        return [[os.path.basename(root), st.st_size, st.st_mtime_ns]]
    out = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if not x.startswith("."))
        for name in sorted(files):
            p = os.path.join(d, name)
            st = os.stat(p)
            out.append([os.path.relpath(p, root), st.st_size, st.st_mtime_ns])
    return out


def source_identity(source: Optional[str], key: str = "stages.mmlu.dataset") -> Optional[dict]:
    """Path and file stats of a local source; None for a hub id (not cached)."""
    if not source:
        return None
    if source_kind(source, key) == "hub":
        return None
    path = os.path.realpath(os.path.expanduser(source))
    return {"path": path, "files": _file_ids(path)}


def tokenizer_identity(tokenizer) -> Optional[dict]:
    """Class, size and tokenizer files of ``tokenizer``; None when it has no local directory."""
    where = getattr(tokenizer, "name_or_path", None)
    if not where or not os.path.isdir(where):
        return None
    where = os.path.realpath(where)
    files = []
    for name in sorted(os.listdir(where)):
        if name in _TOKENIZER_FILES or name.endswith(".tiktoken"):
            st = os.stat(os.path.join(where, name))
            files.append([name, st.st_size, st.st_mtime_ns])
    if not files:
        return None
    return {"class": type(tokenizer).__name__, "size": len(tokenizer), "path": where, "files": files}


def cache_key(dataset: str, dev_dataset: Optional[str], fraction: float, few_shots: int,
              tokenizer) -> Optional[tuple[str, dict]]:
    """(sha256 hex, the parts hashed), or None when something is not cacheable."""
    data = source_identity(dataset)
    tok = tokenizer_identity(tokenizer)
    if data is None or tok is None:
        return None
    dev = None
    if few_shots:
        dev = source_identity(dev_dataset, "stages.mmlu.dev_dataset") if dev_dataset else data
        if dev is None:
            return None
    parts = {"version": VERSION, "dataset": data, "dev_dataset": dev, "fraction": float(fraction),
             "few_shots": int(few_shots), "tokenizer": tok}
    blob = json.dumps(parts, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest(), parts


def entry_path(cache_root: str, key: str) -> str:
    return os.path.join(cache_root, SUBDIR, f"{key}.bin")


def save(path: str, parts: dict, prompts: Sequence[Prompt], ids: Sequence[Sequence[int]]) -> None:
    flat = array("i")
    offsets = [0]
    for row in ids:
        flat.extend(row)
        offsets.append(len(flat))
    header = {"parts": parts, "offsets": offsets, "texts": [p.text for p in prompts],
              "questions": [[q.index, q.subject, q.question, list(q.choices), q.answer]
                            for q in (p.question for p in prompts)]}
    head = json.dumps(header, separators=(",", ":")).encode()
    if sys.byteorder != "little":
        flat.byteswap()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        f.write(flat.tobytes())
    os.replace(tmp, path)


def load(path: str, parts: dict) -> Optional[tuple[list[Prompt], list[list[int]]]]:
    """The entry at ``path`` if it is whole and made from ``parts``; None otherwise."""
    try:
        with open(path, "rb") as f:
            blob = f.read()
        (n,) = struct.unpack_from("<Q", blob, 0)
        header = json.loads(blob[8:8 + n])
        flat = array("i")
        flat.frombytes(blob[8 + n:])
    except (OSError, ValueError, struct.error):
        return None
    if sys.byteorder != "little":
        flat.byteswap()
    offsets = header.get("offsets") or [0]
    if header.get("parts") != parts or offsets[-1] != len(flat) or len(offsets) != len(header["texts"]) + 1:
        return None
    prompts = [Prompt(Question(index=q[0], subject=q[1], question=q[2], choices=tuple(q[3]), answer=q[4]), text)
               for q, text in zip(header["questions"], header["texts"])]
    ids = [flat[a:b].tolist() for a, b in zip(offsets, offsets[1:])]
    return prompts, ids


def build(dataset: str, dev_dataset: Optional[str], fraction: float, few_shots: int,
          tokenizer) -> tuple[list[Prompt], list[list[int]]]:
    """Load, select, render and tokenize (batched) - what a cache miss computes."""
    questions = select_fraction(load_mmlu(dataset, "test"), fraction)
    dev: Sequence[Question] = load_dev(dataset, dev_dataset) if few_shots else ()
    prompts = build_prompts(questions, dev, few_shots)
    return prompts, encode_texts(tokenizer, [p.text for p in prompts])


def prompts_and_ids(dataset: str, dev_dataset: Optional[str], fraction: float, few_shots: int,
                    tokenizer, cache_root: Optional[str] = None):
    """(prompts, ids, info): info = {"cache": "hit"|"miss"|"off", "path", "seconds", "error"?}."""
    t0 = time.perf_counter()
    key = cache_key(dataset, dev_dataset, fraction, few_shots, tokenizer) if cache_root else None
    if key is None:
        prompts, ids = build(dataset, dev_dataset, fraction, few_shots, tokenizer)
        return prompts, ids, {"cache": "off", "seconds": time.perf_counter() - t0}
    path = entry_path(cache_root, key[0])
    hit = load(path, key[1])
    if hit is not None:
        return hit[0], hit[1], {"cache": "hit", "path": path, "seconds": time.perf_counter() - t0}
    prompts, ids = build(dataset, dev_dataset, fraction, few_shots, tokenizer)
    info = {"cache": "miss", "path": path}
    if prompts:
        try:
            save(path, key[1], prompts, ids)
        except OSError as e:
            info["error"] = f"token cache not written: {e}"
    info["seconds"] = time.perf_counter() - t0
    return prompts, ids, info
