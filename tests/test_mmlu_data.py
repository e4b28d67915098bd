"""MMLU sources: CSV dir, jsonl, HF datasets dir (parquet and save_to_disk) give the same questions."""
import csv
import json
import os

import pytest

from launcher.mmlu.data import LETTERS, MmluDataError, Question, check_source, load_dev, load_mmlu

ROWS = {
    "test": [
        ("anatomy", "What bone is in the ear?", ["stapes", "femur", "ulna", "tibia"], 0),
        ("anatomy", "Question, with \"quotes\" and comma", ["a, b", "c", "d", "e"], 3),
        ("astronomy", "  Which planet is red?\n", ["Mars", "Venus", "Earth", "Jupiter"], 0),
        ("astronomy", "How many moons has Mars?", ["0", "1", "2", "3"], 2),
        ("astronomy", "Sun type?", ["G", "M", "K", "O"], 0),
    ],
    "dev": [
        ("anatomy", "dev anatomy 1", ["w", "x", "y", "z"], 1),
        ("astronomy", "dev astronomy 1", ["w", "x", "y", "z"], 2),
        ("astronomy", "dev astronomy 2", ["w", "x", "y", "z"], 3),
    ],
}


def expected(split):
    return [Question(i, s, qq, tuple(c), a) for i, (s, qq, c, a) in enumerate(ROWS[split])]


def write_csv_dir(root):
    for split, rows in ROWS.items():
        d = os.path.join(root, "data", split)
        os.makedirs(d, exist_ok=True)
        by = {}
        for s, qq, c, a in rows:
            by.setdefault(s, []).append([qq, *c, LETTERS[a]])
        for s, rs in by.items():
            with open(os.path.join(d, f"{s}_{split}.csv"), "w", newline="") as f:
                csv.writer(f).writerows(rs)
    return root


def write_jsonl(path, split):
    with open(path, "w") as f:
        for s, qq, c, a in ROWS[split]:
            f.write(json.dumps({"question": qq, "subject": s, "choices": c, "answer": a}) + "\n")
    return path


def hf_dataset(split):
    import datasets

    return datasets.Dataset.from_list(
        [{"question": qq, "subject": s, "choices": c, "answer": a} for s, qq, c, a in ROWS[split]])


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    import datasets

    root = tmp_path_factory.mktemp("mmlu")
    csv_dir = write_csv_dir(str(root / "csv"))
    jsonl = write_jsonl(str(root / "test.jsonl"), "test")
    dev_jsonl = write_jsonl(str(root / "dev.jsonl"), "dev")
    pq = root / "hf_parquet" / "all"
    pq.mkdir(parents=True)
    for split in ("test", "dev"):
        hf_dataset(split).to_parquet(str(pq / f"{split}-00000-of-00001.parquet"))
    saved = str(root / "hf_saved")
    datasets.DatasetDict({s: hf_dataset(s) for s in ("test", "dev")}).save_to_disk(saved)
    return {"csv": csv_dir, "csv_data": os.path.join(csv_dir, "data"), "jsonl": jsonl,
            "dev_jsonl": dev_jsonl, "parquet": str(root / "hf_parquet"), "saved": saved}


@pytest.mark.parametrize("kind,src", [("csv_dir", "csv"), ("csv_dir", "csv_data"), ("jsonl", "jsonl"),
                                      ("hf_dir", "parquet"), ("hf_dir", "saved")])
def test_all_formats_same_questions(sources, kind, src):
    assert check_source(sources[src]) == kind
    assert load_mmlu(sources[src], "test") == expected("test")


@pytest.mark.parametrize("src", ["csv", "parquet", "saved"])
def test_dev_split(sources, src):
    assert load_mmlu(sources[src], "dev") == expected("dev")
    assert load_dev(sources[src]) == expected("dev")


def test_jsonl_dev_from_dev_dataset(sources):
    assert load_dev(sources["jsonl"], sources["dev_jsonl"]) == expected("dev")
    assert load_dev(sources["jsonl"], sources["csv"]) == expected("dev")
    with pytest.raises(MmluDataError) as e:
        load_dev(sources["jsonl"])
    assert "is a jsonl with no dev split; few_shots > 0 needs stages.mmlu.dev_dataset" in str(e.value)


def test_subject_filter_keeps_indices(sources):
    got = load_mmlu(sources["csv"], "test", subjects=["astronomy"])
    assert [x.index for x in got] == [2, 3, 4]


def test_missing_path_names_key(tmp_path):
    missing = str(tmp_path / "nope")
    with pytest.raises(MmluDataError) as e:
        check_source(missing)
    assert str(e.value) == f"stages.mmlu.dataset={missing!r}: no such file or directory"
    with pytest.raises(MmluDataError, match=r"^stages.mmlu.dev_dataset="):
        check_source(missing, "stages.mmlu.dev_dataset")


def test_unusable_dir_and_file(tmp_path):
    with pytest.raises(MmluDataError, match="neither an HF datasets dir"):
        check_source(str(tmp_path))
    f = tmp_path / "x.csv"
    f.write_text("a")
    with pytest.raises(MmluDataError, match="a file must be a .jsonl"):
        check_source(str(f))


def test_hub_id_offline_vs_online(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(MmluDataError) as e:
        check_source("cais/mmlu")
    assert "hub id cannot be used with HF_HUB_OFFLINE set" in str(e.value)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    assert check_source("cais/mmlu") == "hub"


def test_bad_records(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text(json.dumps({"question": "q", "subject": "s", "choices": ["a", "b"], "answer": 0}) + "\n")
    with pytest.raises(MmluDataError, match=r"bad.jsonl:1: expected 4 choices, got 2"):
        load_mmlu(str(p))
    p.write_text(json.dumps({"question": "q", "subject": "s", "choices": list("abcd"), "answer": 7}) + "\n")
    with pytest.raises(MmluDataError, match=r"answer=7 is not one of 0-3 or A-D"):
        load_mmlu(str(p))


def test_split_invalid(sources):
    with pytest.raises(MmluDataError, match=r"split='val': valid splits are \['test', 'dev'\]"):
        load_mmlu(sources["csv"], "val")


SHARED = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "mmlu", "test.jsonl")


@pytest.mark.skipif(not os.path.isfile(SHARED), reason="shared MMLU test.jsonl absent")
def test_shared_mmlu_jsonl():
    qs = load_mmlu(SHARED)
    assert len(qs) == 14042
    assert len({x.subject for x in qs}) == 57
    assert qs[0].subject == "abstract_algebra" and qs[0].answer == 1
