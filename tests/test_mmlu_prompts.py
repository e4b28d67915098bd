"""lm-evaluation-harness MMLU prompt rendering, fraction selection and batching (pure Python)."""
import sys

import pytest

from launcher.mmlu.batching import make_batches, padding_efficiency
from launcher.mmlu.data import Question
from launcher.mmlu.prompts import build_prompt, build_prompts, description, select_fraction


def q(i, subject, text, choices, answer):
    return Question(i, subject, text, tuple(choices), answer)


DEV = [
    q(0, "abstract_algebra", "Find all c in Z_3 such that Z_3[x]/(x^2 + c) is a field.",
      ["0", "1", "2", "3"], 1),
    q(1, "abstract_algebra", " Statement 1 | If aH is an element of a factor group, then |aH| divides |a|. ",
      ["True, True", "False, False", "True, False", "False, True"], 1),
    q(2, "abstract_algebra", "third dev", ["w", "x", "y", "z"], 3),
    q(3, "anatomy", "What is the embryological origin of the hyoid bone?", ["a", "b", "c", "d"], 3),
]
TEST = q(7, "abstract_algebra", "  Find the degree for the given field extension Q(sqrt(2)) over Q.\n",
         ["0", "4", "2", "6"], 2)


def test_zero_shot_exact():
    assert build_prompt(TEST) == (
        "The following are multiple choice questions (with answers) about abstract algebra.\n\n"
        "Find the degree for the given field extension Q(sqrt(2)) over Q.\n"
        "A. 0\nB. 4\nC. 2\nD. 6\nAnswer:")


def test_two_shot_exact_first_k_of_same_subject_in_order():
    [p] = build_prompts([TEST], DEV, few_shots=2)
    assert p.text == (
        "The following are multiple choice questions (with answers) about abstract algebra.\n\n"
        "Find all c in Z_3 such that Z_3[x]/(x^2 + c) is a field.\n"
        "A. 0\nB. 1\nC. 2\nD. 3\nAnswer: B\n\n"
        "Statement 1 | If aH is an element of a factor group, then |aH| divides |a|.\n"
        "A. True, True\nB. False, False\nC. True, False\nD. False, True\nAnswer: B\n\n"
        "Find the degree for the given field extension Q(sqrt(2)) over Q.\n"
        "A. 0\nB. 4\nC. 2\nD. 6\nAnswer:")
    assert p.question is TEST


def test_description_uses_subject_words():
    assert description("high_school_us_history") == (
        "The following are multiple choice questions (with answers) about high school us history.\n\n")


def test_too_few_dev_shots_names_key_and_subject():
    with pytest.raises(ValueError) as e:
        build_prompts([q(0, "anatomy", "x", "abcd", 0)], DEV, few_shots=2)
    assert str(e.value) == ("stages.mmlu.few_shots=2: the dev split has only 1 question(s) for "
                            "subject 'anatomy'")


def _qs(counts):
    out = []
    for s, n in counts.items():
        for k in range(n):
            out.append(q(len(out), s, f"{s} {k}", "abcd", k % 4))
    return out


def test_fraction_first_ceil_per_subject_at_least_one():
    qs = _qs({"a": 10, "b": 3, "c": 1})
    sel = select_fraction(qs, 0.25)
    assert [x.index for x in sel] == [0, 1, 2, 10, 13]      # ceil(2.5)=3, ceil(.75)=1, ceil(.25)=1
    assert [x.index for x in select_fraction(qs, 1.0)] == list(range(14))
    assert [x.index for x in select_fraction(qs, 0.3)] == [0, 1, 2, 10, 13]  # ceil(3.0)=3 exactly


def test_fraction_seeded_sample_deterministic_in_dataset_order():
    qs = _qs({"a": 20, "b": 20})
    s1 = [x.index for x in select_fraction(qs, 0.2, seed=7)]
    assert s1 == [x.index for x in select_fraction(qs, 0.2, seed=7)]
    assert len(s1) == 8 and s1 == sorted(s1)
    assert sum(i < 20 for i in s1) == 4


@pytest.mark.parametrize("bad", [0, -0.1, 1.5, True, "0.5"])
def test_fraction_invalid(bad):
    with pytest.raises(ValueError, match=r"stages.mmlu.fraction=.*must be in \(0, 1\]"):
        select_fraction(_qs({"a": 2}), bad)


def test_batches_sorted_bounded_by_rows_and_tokens():
    lengths = [5, 9, 3, 9, 7, 2, 8]
    bs = make_batches(lengths, batch_size=3)
    assert [b.items for b in bs] == [(1, 3, 6), (4, 0, 2), (5,)]
    assert [b.shape for b in bs] == [(3, 9), (3, 7), (1, 2)]
    bs = make_batches(lengths, batch_size=8, max_batch_tokens=20)
    # 9,9 (18) | 8,7 (16) | 5,3,2 (15) -- a third row of 9 or 8 would exceed 20
    assert [b.items for b in bs] == [(1, 3), (6, 4), (0, 2, 5)]
    assert padding_efficiency(bs) == pytest.approx(43 / (18 + 16 + 15))
    assert [b.items for b in make_batches([30, 4], 4, max_batch_tokens=10)] == [(0,), (1,)]


def test_batching_invalid():
    with pytest.raises(ValueError, match=r"stages.mmlu.batch_size=0: must be an integer >= 1"):
        make_batches([1], 0)
    with pytest.raises(ValueError, match=r"stages.mmlu.max_batch_tokens=0"):
        make_batches([1], 1, 0)


def test_pure_modules_do_not_import_torch():
    import subprocess

    code = ("import sys; import launcher.mmlu.data, launcher.mmlu.prompts, launcher.mmlu.batching, "
            "launcher.mmlu.sharding, launcher.mmlu.gate; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.fixture(scope="module")
def byte_tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from launcher_testing.checkpoints import write_byte_tokenizer

    path = str(tmp_path_factory.mktemp("tok"))
    write_byte_tokenizer(path)
    return AutoTokenizer.from_pretrained(path)


@pytest.mark.torch
def test_choice_ids_and_encoding(byte_tokenizer):
    from launcher.mmlu.prompts import Prompt, choice_token_ids, encode_prompts

    tok = byte_tokenizer
    ids = choice_token_ids(tok)
    assert ids == [tok.encode(f" {x}", add_special_tokens=False)[-1] for x in "ABCD"]
    assert len(tok.encode(" A", add_special_tokens=False)) == 2       # byte level: " " and "A"
    p = Prompt(TEST, build_prompt(TEST))
    [enc], truncated = encode_prompts([p], tok)                       # add_bos None: no BOS
    assert enc == tok.encode(p.text, add_special_tokens=False) and truncated == 0
    [short], truncated = encode_prompts([p], tok, max_seq_len=10)     # left-truncated, end kept
    assert short == enc[-10:] and truncated == 1
    with pytest.raises(ValueError) as e:
        encode_prompts([p], tok, add_bos=True)
    assert str(e.value) == ("stages.mmlu.add_bos=true but the tokenizer has no BOS token; valid: "
                            "null (lm-eval default: no BOS) or false")
