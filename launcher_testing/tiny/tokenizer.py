"""A byte-level BPE tokenizer trained on the synthetic corpus, saved as a PreTrainedTokenizerFast.

Byte-level (GPT-2 style) so any text encodes; no BOS is added automatically (like Qwen), so a
prompt's tokens are exactly its text's tokens.  " A", " B", " C", " D" are forced to single
tokens (MMLU scoring reads their logits at the last prompt position).
"""
from __future__ import annotations

from typing import Iterable

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
ANSWER_TOKENS = (" A", " B", " C", " D")


def train_tokenizer(texts: Iterable[str], vocab_size: int):
    """Train a byte-level BPE on `texts`; returns a transformers PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 300:
        raise ValueError(f"vocab_size must be >= 300 (256 bytes + specials + merges), got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN, PAD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Put the answer tokens in the corpus often enough that BPE must merge them.
    letters = ["Answer: A Answer: B Answer: C Answer: D"] * 64
    tok.train_from_iterator(list(texts) + letters, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=None,
        clean_up_tokenization_spaces=False,
        model_max_length=2048,
    )
    answer_token_ids(fast)  # fail early if a letter is not one token
    return fast


def save_tokenizer(tokenizer, directory) -> None:
    """save_pretrained, naming the class PreTrainedTokenizerFast so transformers 4.x loads it too
    (transformers 5 writes its own name, TokenizersBackend, which 4.x does not know)."""
    import json
    import os

    tokenizer.save_pretrained(directory)
    path = os.path.join(directory, "tokenizer_config.json")
    with open(path, encoding="utf-8") as f:
        cfg = json.load(f)
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    with open(path, "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
        f.write("\n")


def answer_token_ids(tokenizer) -> list[int]:
    """Ids of " A".." D"; ValueError unless each is exactly one token."""
    ids = []
    for t in ANSWER_TOKENS:
        enc = tokenizer.encode(t, add_special_tokens=False)
        if len(enc) != 1:
            raise ValueError(f"{t!r} encodes to {len(enc)} tokens {enc}; MMLU scoring needs exactly one")
        ids.append(enc[0])
    return ids
