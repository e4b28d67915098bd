"""``batch_size: auto`` (token budget from the device, fill cut) and the token-id cache.

Pure Python except the tokenizer: the tiny model's BPE tokenizer (transformers, fast) on the
tiny model's MMLU files, zero-shot and 2-shot, through ``launcher.mmlu.prepared.prepare``.
"""
from __future__ import annotations

import os
import shutil

import pytest

from launcher.mmlu.batching import (FILL_CANDIDATES, OVERHEAD_TOKENS_DENSE, OVERHEAD_TOKENS_MOE, BatchLimits,
                                    activation_bytes_per_token, auto_batch_tokens, batch_cost, choose_min_fill,
                                    make_batches, make_batches_for, resolve_limits)

GiB = 1 << 30


# ------------------------------------------------------------------------------ auto batching

def test_auto_on_cpu_keeps_the_old_default():
    assert resolve_limits("auto", None, "cpu") == BatchLimits(8, None, None, "auto-cpu")
    assert resolve_limits("auto", 2048, "cpu") == BatchLimits(8, 2048, None, "auto-cpu")
    assert resolve_limits(16, 4096, "cuda") == BatchLimits(16, 4096, None, "explicit")


def test_auto_on_cuda_sizes_the_budget_from_the_device():
    dense = activation_bytes_per_token(2048, 8192)                  # Llama-3.2-1B shape
    assert dense == 2 * (4 * 2048 + 3 * 8192)
    moe = activation_bytes_per_token(2048, 6144, topk=8, moe_ffn=768)
    assert moe == 2 * (18 * 2048 + 24 * 768)
    # 10% of 141 GB holds > 65,536 tokens of either: the cap
    assert resolve_limits("auto", None, "cuda", 141 * GiB, dense) == BatchLimits(
        None, 65536, None, "auto-device", OVERHEAD_TOKENS_DENSE)
    assert resolve_limits("auto", None, "cuda", 141 * GiB, moe, moe=True).overhead_tokens == OVERHEAD_TOKENS_MOE
    # a 120B-class MoE (hidden 8192, 22 experts of 2688 per token) on 80 GB: 8 GB / 1.14 MB = 7.5k -> 4096
    big = activation_bytes_per_token(8192, 16384, topk=22, moe_ffn=2688)
    assert auto_batch_tokens(80 * GiB, big) == 4096
    assert auto_batch_tokens(16 * GiB, dense) == 16384              # 1.7 GB / 66 kB = 26k -> 16384
    # max_batch_tokens overrides the device's choice; rows stay unlimited
    assert resolve_limits("auto", 8192, "cuda") == BatchLimits(None, 8192, None, "auto-max_batch_tokens",
                                                              OVERHEAD_TOKENS_DENSE)


@pytest.mark.parametrize("bad", [0, -3, "eight", 2.5, True])
def test_batch_size_invalid_names_key_and_valid_values(bad):
    with pytest.raises(ValueError) as e:
        resolve_limits(bad, None, "cuda", 1, 1)
    assert str(e.value) == f"stages.mmlu.batch_size={bad!r}: valid: 'auto' (token budget from the device) or an integer >= 1"


def test_fill_cut_bounds_padding_batch_by_batch():
    lengths = [100, 95, 90, 70, 69, 40, 39, 38, 10]
    plain = make_batches(lengths, None, 1000)
    assert [b.items for b in plain] == [(0, 1, 2, 3, 4, 5, 6, 7, 8)]   # 9 x 100 = 900 fits
    cut = make_batches(lengths, None, 1000, min_fill=0.8)
    # a batch closes when the next prompt is shorter than 80% of its longest
    assert [b.lengths for b in cut] == [(100, 95, 90), (70, 69), (40, 39, 38), (10,)]
    assert all(min(b.lengths) >= 0.8 * b.padded_len for b in cut)
    # the budget still applies: 3 x 100 > 250
    assert [b.lengths for b in make_batches(lengths, None, 250, 0.8)][:2] == [(100, 95), (90,)]
    with pytest.raises(ValueError, match=r"min_fill=0: must be in \(0, 1\]"):
        make_batches(lengths, None, 10, min_fill=0)


def test_auto_fill_minimizes_padding_plus_forward_overhead():
    # a long tail: 4 long prompts over many short ones
    lengths = [400, 300, 200, 120] + [60] * 50 + [50] * 50 + [40] * 50
    costs = {f: batch_cost(make_batches(lengths, None, 65536, f), 2000) for f in FILL_CANDIDATES}
    best = min(FILL_CANDIDATES, key=lambda f: (costs[f], FILL_CANDIDATES.index(f)))
    assert choose_min_fill(lengths, None, 65536, 2000) == best
    # cheap forwards favour a tight fill (little padding), costly ones fewer, fuller batches
    assert choose_min_fill(lengths, None, 65536, 10) == 0.9
    assert choose_min_fill(lengths, None, 65536, 10 ** 6) is None
    auto = make_batches_for(lengths, BatchLimits(None, 65536, None, "auto-device", 2000))
    assert [b.items for b in auto] == [b.items for b in make_batches(lengths, None, 65536, best)]
    assert batch_cost(auto, 2000) == min(costs.values())


# ------------------------------------------------------------------------------ tokenization

@pytest.fixture(scope="module")
def tiny_tok(tiny_dir):
    from launcher.mmlu.prepared import load_tokenizer

    return load_tokenizer(os.path.join(tiny_dir, "hf"))


def _cfg(dataset, **over):
    from omegaconf import OmegaConf

    from launcher.schema import MmluStage

    return OmegaConf.merge(OmegaConf.structured(MmluStage(dataset=dataset)), over)


@pytest.mark.parametrize("few_shots", [0, 2])
def test_batched_encoding_and_cache_give_todays_ids(tiny_dir, tiny_tok, tmp_path, few_shots):
    from launcher.mmlu.data import load_dev, load_mmlu
    from launcher.mmlu.prompts import build_prompts, select_fraction
    from launcher.mmlu.prepared import prepare

    assert tiny_tok.is_fast
    data = os.path.join(tiny_dir, "mmlu", "data")                       # the CSV dir: test + dev
    # today's path, written out: one encode() per prompt text, then left-truncation
    qs = select_fraction(load_mmlu(data, "test"), 0.5)
    prompts = build_prompts(qs, load_dev(data) if few_shots else (), few_shots)
    full = [tiny_tok.encode(p.text, add_special_tokens=False) for p in prompts]
    # few-shot prompts are truncated (the question end is kept); zero-shot ones are not
    msl = max(map(len, full)) - 10 if few_shots else 4096
    expected = [ids[-msl:] for ids in full]
    n_truncated = sum(len(ids) > msl for ids in full)
    assert (n_truncated > 0) == (few_shots > 0)
    cfg = _cfg(data, fraction=0.5, few_shots=few_shots, max_seq_len=msl)

    cache = str(tmp_path / "cache")
    off = prepare(cfg, tiny_tok)                                        # batched encode, no cache
    miss = prepare(cfg, tiny_tok, cache_root=cache)
    hit = prepare(cfg, tiny_tok, cache_root=cache)
    assert (off.token_cache["cache"], miss.token_cache["cache"], hit.token_cache["cache"]) == ("off", "miss", "hit")
    for prep in (off, miss, hit):
        assert prep.token_ids == expected
        assert [p.question for p in prep.prompts] == qs
        assert [p.text for p in prep.prompts] == [p.text for p in prompts]
        assert prep.truncated == n_truncated
    assert [b.items for b in hit.batches] == [b.items for b in off.batches]
    assert len(os.listdir(os.path.join(cache, "mmlu-tokens"))) == 1


def test_cache_key_follows_dataset_tokenizer_and_shots(tiny_dir, tiny_tok, tmp_path):
    from launcher.mmlu.token_cache import cache_key
    from launcher.mmlu.prepared import load_tokenizer, prepare

    data = str(tmp_path / "data")
    shutil.copytree(os.path.join(tiny_dir, "mmlu", "data"), data)
    cache = str(tmp_path / "cache")
    base = cache_key(data, None, 0.5, 0, tiny_tok)[0]
    assert cache_key(data, None, 0.5, 1, tiny_tok)[0] != base
    assert cache_key(data, None, 0.25, 0, tiny_tok)[0] != base
    tok_dir = str(tmp_path / "tok")
    shutil.copytree(os.path.join(tiny_dir, "hf"), tok_dir, ignore=shutil.ignore_patterns("*.safetensors"))
    assert cache_key(data, None, 0.5, 0, load_tokenizer(tok_dir))[0] != base   # another tokenizer dir

    first = prepare(_cfg(data, fraction=0.5), tiny_tok, cache_root=cache)
    # an edited dataset file is a new key: its new question is seen, not the cached one
    csv_path = os.path.join(data, "test", sorted(os.listdir(os.path.join(data, "test")))[0])
    with open(csv_path) as f:
        lines = f.readlines()
    lines[0] = '"What is an edited question?",a,b,c,d,A\n'
    with open(csv_path, "w") as f:
        f.writelines(lines)
    second = prepare(_cfg(data, fraction=0.5), tiny_tok, cache_root=cache)
    assert second.token_cache["cache"] == "miss"
    assert second.prompts[0].question.question == "What is an edited question?"
    assert second.token_ids[0] != first.token_ids[0]
    # a corrupt entry is rebuilt, not trusted
    with open(second.token_cache["path"], "r+b") as f:
        f.truncate(100)
    third = prepare(_cfg(data, fraction=0.5), tiny_tok, cache_root=cache)
    assert third.token_cache["cache"] == "miss" and third.token_ids == second.token_ids
