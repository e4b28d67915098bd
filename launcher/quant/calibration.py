"""Calibration data from a local path, tokenized into identical batches on every rank.

Sources (``calib.dataset``):

* ``*.jsonl``: one JSON object a line; the ``text_key`` field, else a chat ``messages`` list
  rendered with the tokenizer's chat template (joined contents when it has none);
* ``*.txt``: paragraphs separated by blank lines;
* a directory written by ``datasets.Dataset.save_to_disk`` (``load_from_disk``; the ``train``
  split of a DatasetDict, else its first split), same fields as jsonl.

Texts are tokenized, joined with EOS and packed into ``size`` samples of ``max_seq_len``
tokens (shorter when the data holds fewer tokens; no padding, so every token is real), grouped
into batches of ``batch_size``.  The process is deterministic and reads nothing rank-specific,
so every rank builds the same batches: calibration forwards are collectives (EP all-to-all,
PP send/recv) and every rank must make the same number of them.
"""
from __future__ import annotations

import json
import os
from typing import Any, Iterable

from launcher.contract import UserError


def _render(record: dict[str, Any], text_key: str, tokenizer, where: str) -> str:
    if not isinstance(record, dict):
        record = {}
    if isinstance(record.get(text_key), str):
        return record[text_key]
    messages = record.get("messages")
    if isinstance(messages, list) and messages:
        if getattr(tokenizer, "chat_template", None):
            return tokenizer.apply_chat_template(messages, tokenize=False)
        return "\n".join(str(m.get("content", "")) for m in messages if isinstance(m, dict))
    raise UserError(f"{where}: record has neither a string {text_key!r} field (stages.quantize.calib.text_key) "
                    f"nor a 'messages' list (keys: {sorted(record) if isinstance(record, dict) else type(record).__name__})")


def _jsonl_records(path: str) -> Iterable[tuple[dict, str]]:
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                try:
                    yield json.loads(line.rstrip("\r\n")), f"{path}:{lineno}"
                except json.JSONDecodeError as e:
                    raise UserError(f"{path}:{lineno}: not JSON: {e}; valid: one JSON object a line") from e


def _named(path: str, e: Exception) -> UserError:
    text = str(e)
    return UserError(text if text.startswith("stages.quantize.") else f"stages.quantize.calib.dataset={path!r}: {text}")


def load_calibration_texts(path: str, size: int, text_key: str = "text", tokenizer=None) -> list[str]:
    """Up to ``size`` non-empty texts from ``path`` (in file order); UserError naming the key."""
    try:
        return _load_texts(path, size, text_key, tokenizer)
    except UserError as e:
        raise _named(path, e) from e


def _load_texts(path: str, size: int, text_key: str, tokenizer) -> list[str]:
    if size < 1:
        raise ValueError(f"calib.size must be >= 1, got {size}")
    if not os.path.exists(path):
        raise UserError(f"stages.quantize.calib.dataset={path!r} does not exist")
    texts: list[str] = []
    if os.path.isdir(path):
        import datasets

        data = datasets.load_from_disk(path)
        if isinstance(data, datasets.DatasetDict):
            data = data["train"] if "train" in data else data[next(iter(data))]
        for i, record in enumerate(data):
            texts.append(_render(record, text_key, tokenizer, f"{path}[{i}]"))
            if len(texts) >= size:
                break
    elif path.endswith(".jsonl"):
        for record, where in _jsonl_records(path):
            texts.append(_render(record, text_key, tokenizer, where))
            if len(texts) >= size:
                break
    elif path.endswith(".txt"):
        with open(path) as f:
            paragraphs = [p.strip() for p in f.read().split("\n\n")]
        texts = [p for p in paragraphs if p][:size]
    else:
        raise UserError(f"stages.quantize.calib.dataset={path!r}: expected a .jsonl file, a .txt file or a "
                         "datasets directory (save_to_disk)")
    texts = [t for t in texts if t.strip()]
    if not texts:
        raise UserError(f"stages.quantize.calib.dataset={path!r} holds no calibration text")
    return texts


def check_contents(path: str, size: int, text_key: str) -> list[str]:
    """Validation's reading of the calibration data (no tokenizer, no torch), one line per problem:
    the records the stage reads (JSON lines, each with a string ``text_key`` field or a ``messages``
    list; or .txt paragraphs), and at least ``size`` non-empty texts, one per sample (fewer would
    calibrate on fewer, shorter samples than ``calib.size`` asks).  Reads at most ``size`` texts;
    a ``save_to_disk`` directory must have its layout (its records are read by the stage)."""
    key = "stages.quantize.calib.dataset"
    if os.path.isdir(path):
        if any(os.path.isfile(os.path.join(path, f)) for f in ("dataset_dict.json", "state.json")):
            return []
        return [f"{key}={path!r}: a directory without dataset_dict.json or state.json; valid: a directory "
                "written by datasets' save_to_disk, a .jsonl or a .txt file"]
    try:
        texts = 0
        if path.endswith(".jsonl"):
            for record, where in _jsonl_records(path):
                texts += bool(_render(record, text_key, None, where).strip())
                if texts >= size:
                    return []
        elif path.endswith(".txt"):
            with open(path, encoding="utf-8") as f:
                texts = sum(1 for p in f.read().split("\n\n") if p.strip())
        else:
            load_calibration_texts(path, size, text_key)   # its refusal names what is valid
    except (UserError, UnicodeDecodeError) as e:
        return [str(_named(path, e))]
    if texts == 0:
        return [f"{key}={path!r}: holds no calibration text; valid: a file with at least "
                f"stages.quantize.calib.size={size} texts"]
    if texts < size:
        return [f"stages.quantize.calib.size={size}: {path} holds {texts} calibration text(s), one per sample "
                f"at least; valid: calib.size <= {texts}, or more data"]
    return []


def pack_tokens(token_lists: list[list[int]], size: int, max_seq_len: int, eos_id: int | None) -> list[list[int]]:
    """Join the token lists (EOS between) and cut ``size`` equal samples of <= max_seq_len tokens."""
    if max_seq_len < 1:
        raise ValueError(f"calib.max_seq_len must be >= 1, got {max_seq_len}")
    stream: list[int] = []
    for tokens in token_lists:
        stream.extend(tokens)
        if eos_id is not None:
            stream.append(eos_id)
    seq_len = min(max_seq_len, len(stream) // size)
    if seq_len < 1:
        raise ValueError(f"calibration data has {len(stream)} tokens: too few for calib.size={size} samples")
    return [stream[i * seq_len:(i + 1) * seq_len] for i in range(size)]


def build_calibration_batches(tokenizer, texts: list[str], size: int, max_seq_len: int, batch_size: int):
    """List of LongTensor batches [batch_size, seq] (the last one may be smaller)."""
    import torch

    if batch_size < 1:
        raise ValueError(f"calib.batch_size must be >= 1, got {batch_size}")
    token_lists = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    samples = pack_tokens(token_lists, size, max_seq_len, tokenizer.eos_token_id)
    return [torch.tensor(samples[i:i + batch_size], dtype=torch.long)
            for i in range(0, len(samples), batch_size)]


def calibration_batches(calib_cfg, tokenizer_path: str, trust_remote_code: bool = False):
    """Batches for a CalibConfig (dataset, size, max_seq_len, batch_size, text_key)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path, trust_remote_code=trust_remote_code)
    texts = load_calibration_texts(calib_cfg.dataset, calib_cfg.size, calib_cfg.text_key, tokenizer)
    return build_calibration_batches(tokenizer, texts, calib_cfg.size, calib_cfg.max_seq_len,
                                     calib_cfg.batch_size)
