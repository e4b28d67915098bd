"""MMLU questions from exactly the configured source - pure Python except the HF-datasets path.

Sources (``stages.mmlu.dataset`` / ``stages.mmlu.dev_dataset``), detected by ``source_kind``:

* ``hf_dir``  - a local HF datasets directory in the cais/mmlu layout: config ``all`` with splits
  ``test`` and ``dev``: ``<dir>/all/{test,dev}-*.parquet`` (the Hub repo layout), or a
  ``save_to_disk`` DatasetDict (``<dir>/dataset_dict.json`` or ``<dir>/all/dataset_dict.json``).
  Loaded with ``datasets`` (imported lazily).
* ``csv_dir`` - the original Hendrycks CSVs: ``<dir>/data/{dev,test}/<subject>_{dev,test}.csv``
  (``<dir>`` may also be the ``data`` directory itself); no header, rows
  ``question,A,B,C,D,letter``.  Subjects in alphabetical order (as cais/mmlu "all").
* ``jsonl``   - one question a line in the cais schema ``{question, subject, choices[4], answer}``
  (``answer`` 0-3 or a letter).  A jsonl file is a single split: asking it for ``dev`` is an
  error unless it is given as ``dev_dataset``.
* ``hub``     - a hub id (``cais/mmlu``), only when online (``HF_HUB_OFFLINE`` unset).

``Question.index`` is the position of the question in the loaded split: the "dataset index"
``mmlu/results.json`` reports.
"""
from __future__ import annotations

import contextlib
import csv
import glob
import json
import os
from dataclasses import dataclass
from typing import Iterable, Optional

from launcher.contract import UserError

LETTERS = ("A", "B", "C", "D")
SPLITS = ("test", "dev")
KINDS = ("hf_dir", "csv_dir", "jsonl", "hub")


@dataclass(frozen=True)
class Question:
    index: int                 # position in the loaded split
    subject: str               # underscored, e.g. "abstract_algebra"
    question: str
    choices: tuple[str, str, str, str]
    answer: int                # 0..3


class MmluDataError(UserError):
    """A dataset source that cannot be used; the message names the config key."""


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() not in ("", "0", "false", "no")


def _looks_like_hub_id(source: str) -> bool:
    if source.startswith(("/", ".", "~")) or source.endswith((".jsonl", ".json", ".csv", ".parquet")):
        return False
    parts = source.split("/")
    return len(parts) <= 2 and all(p and not p.startswith(".") for p in parts)


def _csv_root(path: str) -> Optional[str]:
    for root in (os.path.join(path, "data"), path):
        if glob.glob(os.path.join(root, "test", "*_test.csv")) or glob.glob(
                os.path.join(root, "dev", "*_dev.csv")):
            return root
    return None


def _hf_layout(path: str) -> Optional[str]:
    """'parquet' | 'saved' | None for a directory."""
    if (glob.glob(os.path.join(path, "all", "test-*.parquet"))
            or glob.glob(os.path.join(path, "all", "dev-*.parquet"))):
        return "parquet"
    if (os.path.isfile(os.path.join(path, "dataset_dict.json"))
            or os.path.isfile(os.path.join(path, "all", "dataset_dict.json"))):
        return "saved"
    return None


def source_kind(source: str, key: str = "stages.mmlu.dataset") -> str:
    """Which of KINDS ``source`` is; MmluDataError naming ``key`` when it is none of them."""
    if not isinstance(source, str) or not source:
        raise MmluDataError(f"{key}={source!r}: expected a path (HF datasets dir, CSV dir, jsonl) "
                            f"or a hub id")
    path = os.path.expanduser(source)
    if os.path.isfile(path):
        if path.endswith(".jsonl"):
            return "jsonl"
        raise MmluDataError(f"{key}={source!r}: a file must be a .jsonl in the cais/mmlu schema "
                            f"(question, subject, choices, answer)")
    if os.path.isdir(path):
        if _hf_layout(path):
            return "hf_dir"
        if _csv_root(path):
            return "csv_dir"
        raise MmluDataError(
            f"{key}={source!r}: directory is neither an HF datasets dir in the cais/mmlu layout "
            f"(all/test-*.parquet, all/dev-*.parquet, or a save_to_disk DatasetDict) nor a CSV dir "
            f"(data/test/<subject>_test.csv, data/dev/<subject>_dev.csv)")
    if _looks_like_hub_id(source):
        if _offline():
            raise MmluDataError(f"{key}={source!r}: no such local path, and a hub id cannot be used "
                                f"with HF_HUB_OFFLINE set; give a local dataset path")
        return "hub"
    raise MmluDataError(f"{key}={source!r}: no such file or directory")


def check_source(source: str, key: str = "stages.mmlu.dataset") -> str:
    """Config-validation check (no torch, no datasets import): returns the kind or raises."""
    return source_kind(source, key)


def _answer_index(value, where: str) -> int:
    if isinstance(value, bool):
        raise MmluDataError(f"{where}: answer={value!r} is not one of 0-3 or A-D")
    if isinstance(value, int) and 0 <= value <= 3:
        return value
    if isinstance(value, str) and value.strip().upper() in LETTERS:
        return LETTERS.index(value.strip().upper())
    if isinstance(value, str) and value.strip() in ("0", "1", "2", "3"):
        return int(value.strip())
    raise MmluDataError(f"{where}: answer={value!r} is not one of 0-3 or A-D")


def _question(index: int, subject: str, question: str, choices, answer, where: str) -> Question:
    if not isinstance(choices, (list, tuple)) or len(choices) != 4:
        got = len(choices) if isinstance(choices, (list, tuple)) else type(choices).__name__
        raise MmluDataError(f"{where}: expected 4 choices, got {got}")
    for name, value in (("question", question), ("subject", subject)):
        if not isinstance(value, str) or not value.strip():
            raise MmluDataError(f"{where}: {name}={value!r}; valid: a non-empty string")
    return Question(index=index, subject=str(subject), question=str(question),
                    choices=tuple(str(c) for c in choices), answer=_answer_index(answer, where))


def _records(rows: Iterable[dict], where: str, places: Optional[list[str]] = None) -> list[Question]:
    """Questions from cais-schema rows; ``places[i]`` names row i (a file's line), else
    ``<where> record <i>``."""
    out = []
    for i, row in enumerate(rows):
        place = places[i] if places is not None else f"{where} record {i}"
        if not isinstance(row, dict):
            raise MmluDataError(f"{place}: a {type(row).__name__}, not a record {{question, subject, choices, answer}}")
        missing = [k for k in ("question", "subject", "choices", "answer") if k not in row]
        if missing:
            raise MmluDataError(f"{place}: missing keys {missing} (cais/mmlu schema: "
                                f"question, subject, choices, answer)")
        out.append(_question(i, row["subject"], row["question"], row["choices"], row["answer"], place))
    return out


def _load_jsonl(path: str) -> list[Question]:
    with open(path, encoding="utf-8") as f:
        lines = [(n, line) for n, line in enumerate(f, 1) if line.strip()]
    places = [f"{path}:{n}" for n, _ in lines]
    try:   # one decoder call for the whole file (the full MMLU split in a fraction of a second)
        rows = json.loads("[" + ",".join(line for _, line in lines) + "]")
    except json.JSONDecodeError:
        rows = None
    if rows is None or len(rows) != len(lines):   # find the line that is not one JSON value
        rows = []
        for n, line in lines:
            try:
                rows.append(json.loads(line.rstrip("\r\n")))   # the error's column is the line's
            except json.JSONDecodeError as e:
                raise MmluDataError(f"{path}:{n}: not JSON: {e}; valid: one JSON object a line") from e
    return _records(rows, path, places)


def _load_csv_dir(path: str, split: str) -> list[Question]:
    root = _csv_root(path)
    files = sorted(glob.glob(os.path.join(root, split, f"*_{split}.csv")))
    if not files:
        raise MmluDataError(f"{path}: no {split} split (expected {root}/{split}/<subject>_{split}.csv)")
    out: list[Question] = []
    suffix = f"_{split}.csv"
    for file in files:
        subject = os.path.basename(file)[: -len(suffix)]
        with open(file, newline="", encoding="utf-8") as f:
            for n, row in enumerate(csv.reader(f), 1):
                if not row:
                    continue
                if len(row) != 6:
                    raise MmluDataError(f"{file}:{n}: expected 6 columns question,A,B,C,D,answer; "
                                        f"got {len(row)}")
                out.append(_question(len(out), subject, row[0], row[1:5], row[5], f"{file}:{n}"))
    return out


def _load_hf_dir(path: str, split: str) -> list[Question]:
    import datasets  # lazy: only this source needs it

    if _hf_layout(path) == "parquet":
        files = sorted(glob.glob(os.path.join(path, "all", f"{split}-*.parquet")))
        if not files:
            raise MmluDataError(f"{path}: no {split} split (expected all/{split}-*.parquet)")
        ds = datasets.load_dataset("parquet", data_files={split: files}, split=split)
    else:
        root = path if os.path.isfile(os.path.join(path, "dataset_dict.json")) else os.path.join(path, "all")
        dd = datasets.load_from_disk(root)
        if split not in dd:
            raise MmluDataError(f"{path}: no {split} split (has {sorted(dd.keys())})")
        ds = dd[split]
    return _records(ds, f"{path}[{split}]")


def _parquet_rows(path: str, split: str) -> Optional[list[dict]]:
    """The rows of the parquet layout's split read with pyarrow alone (None: no pyarrow here, or
    not that layout); what validation reads instead of importing ``datasets``."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        return None
    files = sorted(glob.glob(os.path.join(path, "all", f"{split}-*.parquet")))
    if _hf_layout(path) != "parquet" or not files:
        return None
    rows: list[dict] = []
    for file in files:
        rows.extend(pq.read_table(file).to_pylist())
    return rows


def _load_hub(source: str, split: str) -> list[Question]:
    import datasets

    ds = datasets.load_dataset(source, "all", split=split)
    return _records(ds, f"{source}[{split}]")


@contextlib.contextmanager
def _named(key: str, source: str):
    """A record's problem, prefixed with the config key that named the file."""
    try:
        yield
    except MmluDataError as e:
        if str(e).startswith("stages.mmlu."):
            raise
        raise MmluDataError(f"{key}={source!r}: {e}") from e


def load_mmlu(source: str, split: str = "test", subjects: Optional[Iterable[str]] = None,
              key: str = "stages.mmlu.dataset") -> list[Question]:
    """The questions of one split of ``source``; ``subjects`` filters (indices stay those of
    the whole split)."""
    if split not in SPLITS:
        raise MmluDataError(f"split={split!r}: valid splits are {list(SPLITS)}")
    kind = source_kind(source, key)
    path = os.path.expanduser(source)
    loaders = {"jsonl": lambda: _load_jsonl(path), "csv_dir": lambda: _load_csv_dir(path, split),
               "hf_dir": lambda: _load_hf_dir(path, split), "hub": lambda: _load_hub(source, split)}
    with _named(key, source):
        questions = loaders[kind]()
    if subjects is not None:
        wanted = set(subjects)
        questions = [q for q in questions if q.subject in wanted]
    return questions


def check_contents(dataset: str, dev_dataset: Optional[str], fraction: float, few_shots: int) -> list[str]:
    """Validation's reading of what the gate will read (no torch, no ``datasets``): every record
    of the test split (a question, 4 choices, an answer in range, a subject), a selection that is
    not empty, and with ``few_shots`` a dev split holding enough questions for every selected
    subject.  One line per problem, naming the key, the file and its line or record."""
    from launcher.mmlu.prompts import build_prompts, select_fraction

    def named(e: Exception, key: str, value: str) -> list[str]:
        text = str(e)
        return [text if text.startswith("stages.mmlu.") else f"{key}={value!r}: {text}"]

    try:
        kind = source_kind(dataset, "stages.mmlu.dataset")
        rows = _parquet_rows(os.path.expanduser(dataset), "test") if kind == "hf_dir" else None
        if kind == "hub" or (kind == "hf_dir" and rows is None):
            return []   # a hub id, a save_to_disk directory, or no pyarrow here: the stage reads it
        questions = _records(rows, f"{dataset}[test]") if rows is not None else load_mmlu(dataset, "test")
    except MmluDataError as e:
        return named(e, "stages.mmlu.dataset", dataset)
    if not questions:
        return [f"stages.mmlu.dataset={dataset!r}: holds no questions; valid: a test split with at least one"]
    if not few_shots or (dev_dataset and source_kind(dev_dataset, "stages.mmlu.dev_dataset") == "hf_dir"):
        return []
    try:
        dev = load_dev(dataset, dev_dataset)
        build_prompts(select_fraction(questions, fraction), dev, few_shots)
    except MmluDataError as e:
        return named(e, "stages.mmlu.dev_dataset", dev_dataset) if dev_dataset else [str(e)]
    except ValueError as e:   # build_prompts: too few dev questions for a subject (names the key)
        return [str(e)]
    return []


def load_dev(dataset: str, dev_dataset: Optional[str] = None) -> list[Question]:
    """Few-shot examples: the dev split of ``dev_dataset`` when given (a jsonl is taken whole),
    else the dev split of ``dataset`` (a jsonl ``dataset`` has none: error naming the keys)."""
    if dev_dataset:
        kind = source_kind(dev_dataset, "stages.mmlu.dev_dataset")
        if kind == "jsonl":
            with _named("stages.mmlu.dev_dataset", dev_dataset):
                return _load_jsonl(os.path.expanduser(dev_dataset))
        return load_mmlu(dev_dataset, "dev", key="stages.mmlu.dev_dataset")
    if source_kind(dataset) == "jsonl":
        raise MmluDataError(
            f"stages.mmlu.dataset={dataset!r} is a jsonl with no dev split; few_shots > 0 needs "
            f"stages.mmlu.dev_dataset (a dev jsonl, CSV dir or HF datasets dir) or few_shots=0")
    return load_mmlu(dataset, "dev")
