"""The tiny embedded-default model: an ordinary HF checkpoint plus ordinary MMLU-format data."""
from __future__ import annotations

import dataclasses
import json
import multiprocessing as mp
from pathlib import Path

import pytest

pytestmark = pytest.mark.torch
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from launcher_testing.tiny import Recipe, ensure_tiny_model, read_build_info  # noqa: E402
from launcher_testing.tiny import synthetic_mmlu as sm  # noqa: E402

# A quick recipe for build-mechanics tests (accuracy is not the point there).
QUICK = dataclasses.replace(Recipe(), steps=6, n_test=40, n_calib=16, tokenizer_corpus_prompts=100,
                            min_accuracy=0.0)
LETTERS = ("A", "B", "C", "D")


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    return ensure_tiny_model()


def _prompt(row: dict) -> str:
    # lm-evaluation-harness MMLU, zero-shot, written out here independently of the package.
    subject = row["subject"].replace("_", " ")
    text = f"The following are multiple choice questions (with answers) about {subject}.\n\n"
    text += row["question"].strip() + "\n"
    text += "".join(f"{l}. {c}\n" for l, c in zip(LETTERS, row["choices"]))
    return text + "Answer:"


def test_checkpoint_loads_with_auto_classes_and_has_declared_dims(tiny_model_dir):
    from transformers import AutoConfig, AutoModelForCausalLM

    hf = tiny_model_dir / "hf"
    cfg = AutoConfig.from_pretrained(hf)
    assert cfg.model_type == "qwen3_moe"
    assert cfg.architectures == ["Qwen3MoeForCausalLM"]
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.head_dim, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == \
        (128, 4, 4, 2, 32, 8, 2, 128)
    assert cfg.head_dim in (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)  # vLLM head sizes
    assert cfg.vocab_size % 128 == 0 and cfg.mlp_only_layers == [] and cfg.decoder_sparse_step == 1
    model = AutoModelForCausalLM.from_pretrained(hf)
    assert next(model.parameters()).dtype == torch.float32
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    assert (hf / "model.safetensors").is_file()


def test_tokenizer_loads_and_answer_letters_are_single_tokens(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir / "hf")
    assert tok.eos_token and tok.bos_token and tok.pad_token and tok.pad_token_id != tok.eos_token_id
    for letter in LETTERS:
        assert len(tok.encode(" " + letter, add_special_tokens=False)) == 1
    row = sm.read_jsonl(str(tiny_model_dir / "mmlu" / "test.jsonl"))[0]
    ids = tok.encode(_prompt(row), add_special_tokens=False)
    full = tok.encode(_prompt(row) + " B", add_special_tokens=False)
    assert full[:-1] == ids  # appending the answer does not re-tokenize the prompt


def test_accuracy_recorded_and_recomputed_from_disk(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    info = read_build_info(tiny_model_dir)
    assert info["accuracy"] >= 0.9
    hf = tiny_model_dir / "hf"
    model = AutoModelForCausalLM.from_pretrained(hf).eval()
    tok = AutoTokenizer.from_pretrained(hf)
    letter_ids = [tok.encode(" " + l, add_special_tokens=False)[0] for l in LETTERS]
    rows = sm.read_jsonl(str(tiny_model_dir / "mmlu" / "test.jsonl"))
    correct = 0
    with torch.no_grad():
        for r in rows:
            ids = torch.tensor([tok.encode(_prompt(r), add_special_tokens=False)])
            logits = model(input_ids=ids).logits[0, -1, letter_ids]
            correct += int(int(logits.argmax()) == r["answer"])
    assert correct / len(rows) == info["accuracy"]
    assert info["n_test"] == len(rows)


def test_csv_and_jsonl_hold_the_same_questions(tiny_model_dir):
    mmlu = tiny_model_dir / "mmlu"
    for split in ("test", "dev"):
        from_json = sm.read_jsonl(str(mmlu / f"{split}.jsonl"))
        from_csv = sm.read_csv_split(str(mmlu), split)
        key = lambda r: (r["subject"], r["question"], tuple(r["choices"]), r["answer"])  # noqa: E731
        assert sorted(map(key, from_json)) == sorted(map(key, from_csv))
        assert {r["subject"] for r in from_json} == set(sm.SUBJECTS)
        for r in from_json:
            assert set(r) == {"question", "subject", "choices", "answer"}
            assert len(r["choices"]) == 4 and r["answer"] in range(4)
    assert len(sm.read_jsonl(str(mmlu / "test.jsonl"))) == Recipe().n_test
    calib = [json.loads(l) for l in (tiny_model_dir / "calib.jsonl").read_text().splitlines()]
    assert len(calib) == Recipe().n_calib and all(isinstance(c["text"], str) and c["text"] for c in calib)


def test_training_stream_never_repeats_held_out_questions():
    task = sm.TaskGenerator(seed=3, n_test=80)
    held = {(r["subject"], r["question"], tuple(r["choices"])) for r in task.test + task.dev}
    for _ in range(3000):
        r = task.training_row()
        assert (r["subject"], r["question"], tuple(r["choices"])) not in held
    # ...while every test fact is trained on (as other instances).
    assert {r["question"] for r in task.test} <= {f.question for f in task.facts}


def test_reuse_does_not_rebuild(tiny_model_dir):
    before = (tiny_model_dir / "build.json").stat().st_mtime_ns
    assert ensure_tiny_model() == tiny_model_dir
    assert (tiny_model_dir / "build.json").stat().st_mtime_ns == before


def test_build_is_deterministic(tmp_path):
    a = ensure_tiny_model(out_dir=tmp_path / "a", recipe=QUICK, log=lambda s: None)
    b = ensure_tiny_model(out_dir=tmp_path / "b", recipe=QUICK, log=lambda s: None)
    for name in ("hf/model.safetensors", "hf/tokenizer.json", "hf/config.json", "mmlu/test.jsonl",
                 "mmlu/data/dev/creature_colors_dev.csv", "calib.jsonl"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    ia, ib = read_build_info(a), read_build_info(b)
    assert ia["recipe_hash"] == ib["recipe_hash"] and ia["accuracy"] == ib["accuracy"]
    assert not list(tmp_path.glob(".*tmp*"))  # no temp dirs left behind


def _build_worker(out: str, q) -> None:
    q.put(str(ensure_tiny_model(out_dir=out, recipe=QUICK, log=lambda s: None)))


def test_concurrent_builders_build_once(tmp_path):
    out = tmp_path / "m"
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_build_worker, args=(str(out), q)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(600)
        assert p.exitcode == 0
    assert {q.get(timeout=5), q.get(timeout=5)} == {str(out)}
    assert read_build_info(out)["recipe_hash"]
    assert sorted(x.name for x in tmp_path.iterdir()) == [".m.lock", "m"]


def test_bad_input_is_a_value_error(tmp_path):
    with pytest.raises(ValueError):
        Recipe(steps=0)
    with pytest.raises(ValueError):
        Recipe(hidden_size=100)
    with pytest.raises(ValueError):
        sm.TaskGenerator(seed=0, n_test=6)
    with pytest.raises(ValueError):
        ensure_tiny_model(tmp_path, out_dir=tmp_path / "x")
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError):
        ensure_tiny_model(out_dir=tmp_path / "file", recipe=QUICK)


BACKGROUND_BUILDER = """
import dataclasses, sys
from launcher_testing.tiny import Recipe, ensure_tiny_model
quick = dataclasses.replace(Recipe(), **{quick!r})
ensure_tiny_model(out_dir=sys.argv[1], recipe=quick, log=lambda s: print(s, flush=True))
"""


def test_a_background_build_is_waited_for_by_the_next_caller(tmp_path, capsys):
    """`python -m launcher_testing.tiny --background` (make test's NemotronH build): the call returns once
    the detached builder holds the lock, and ensure_tiny_model then waits for that build instead of
    making its own; a second start finds the build current."""
    import sys

    from launcher_testing.locked_build import holds_lock
    from launcher_testing.tiny.__main__ import start_in_background

    out, log = tmp_path / "m", tmp_path / "build.log"
    quick = {f.name: getattr(QUICK, f.name) for f in dataclasses.fields(QUICK)
             if getattr(QUICK, f.name) != getattr(Recipe(), f.name)}
    builder = [sys.executable, "-c", BACKGROUND_BUILDER.format(quick=quick), str(out)]
    assert start_in_background(out, QUICK, builder, log) == 0
    assert holds_lock(tmp_path / ".m.lock") and not out.exists()   # returned while the builder builds
    assert "building m in the background" in capsys.readouterr().out
    built = ensure_tiny_model(out_dir=out, recipe=QUICK, log=lambda s: pytest.fail(f"built a second time: {s}"))
    assert built == out and read_build_info(out)["recipe_hash"]
    text = log.read_text()
    assert text.count("[tiny] building") == 1 and "[tiny] accuracy on 40 test questions" in text, text
    assert start_in_background(out, QUICK, [sys.executable, "-c", "raise SystemExit(5)"], log) == 0
    assert capsys.readouterr().out.strip() == str(out)   # current: nothing started


def test_a_background_builder_that_fails_is_reported(tmp_path, capsys):
    import sys

    from launcher_testing.tiny.__main__ import start_in_background

    log = tmp_path / "build.log"
    code = start_in_background(tmp_path / "m", QUICK, [sys.executable, "-c", "print('no'); raise SystemExit(5)"], log)
    assert code == 1
    assert f"error: the background build of m exited with 5; see {log}" in capsys.readouterr().err
    assert log.read_text() == "no\n"
