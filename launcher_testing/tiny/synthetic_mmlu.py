"""A synthetic multiple-choice task in the MMLU (cais/mmlu) schema that a tiny model can learn.

Four subjects, each a table of facts whose answer is fully determined by the question:

    creature_colors         "What color is the zorbin?"       -> blue     (invented creatures)
    creature_diets          "What does the zorbin eat?"       -> seeds
    creature_habitats       "Where does the zorbin live?"     -> swamp
    elementary_arithmetic   "What is 3 + 4?"                  -> 7        (1..4 + 1..4)

Each subject's answers come from a small set (8-10 values).  Learning to bind an answer to its
letter is the hard part for a tiny model (a long loss plateau at ln 4); small answer sets
shorten that plateau a lot (measured: large sets of names never left it in 2000 steps).

Every fact is used in training, but as other *instances* (other distractors, other choice
orders): `TaskGenerator.training_row` never returns a (question, choices) pair that is in
the test or dev split.  Everything is drawn from `random.Random` seeded by the caller, so the
same seed gives the same task, byte for byte.

Prompts follow lm-evaluation-harness's MMLU template exactly (`format_prompt`).
"""
from __future__ import annotations

import csv
import json
import os
import random
from dataclasses import dataclass
from typing import Iterable, Sequence

LETTERS = ("A", "B", "C", "D")
SUBJECTS = ("creature_colors", "creature_diets", "creature_habitats", "elementary_arithmetic")

_COLORS = ("red", "blue", "green", "yellow", "purple", "orange", "white", "black")
_HABITATS = ("forest", "desert", "ocean", "river", "mountain", "cave", "swamp", "meadow")
_FOODS = ("seeds", "fish", "grass", "insects", "fruit", "leaves", "roots", "worms")
_ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "gr", "tr", "st")
_VOWELS = ("a", "e", "i", "o", "u")
_CODAS = ("", "n", "r", "l", "s", "k", "m")


@dataclass(frozen=True)
class Fact:
    subject: str
    question: str
    answer: str
    pool: tuple[str, ...]   # where distractors come from (never contains `answer`)
    statement: str          # the fact as a plain sentence (calibration / tokenizer text)


def _invented_words(rng: random.Random, n: int, syllables: int, taken: set[str]) -> list[str]:
    words: list[str] = []
    while len(words) < n:
        w = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(syllables))
        if w not in taken and len(w) >= 4:
            taken.add(w)
            words.append(w)
    return words


def build_facts(seed: int, n_invented: int = 32) -> list[Fact]:
    """All facts of the task, in a fixed order (depends only on `seed` and `n_invented`)."""
    if n_invented < 8:
        raise ValueError(f"n_invented must be >= 8 (distractors need room), got {n_invented}")
    rng = random.Random(f"facts-{seed}")
    facts: list[Fact] = []
    numbers = tuple(str(i) for i in range(10))
    for a in range(1, 5):
        for b in range(1, 5):
            ans = str(a + b)
            facts.append(Fact("elementary_arithmetic", f"What is {a} + {b}?", ans,
                              tuple(x for x in numbers if x != ans), f"{a} + {b} = {ans}."))
    creatures = _invented_words(rng, n_invented, 2, set(_COLORS + _HABITATS + _FOODS))
    for subject, values, question, statement in (
        ("creature_colors", _COLORS, "What color is the {}?", "The {} is {}."),
        ("creature_habitats", _HABITATS, "Where does the {} live?", "The {} lives in the {}."),
        ("creature_diets", _FOODS, "What does the {} eat?", "The {} eats {}."),
    ):
        for cr in creatures:
            v = rng.choice(values)
            facts.append(Fact(subject, question.format(cr), v, tuple(x for x in values if x != v),
                              statement.format(cr, v)))
    return facts


def make_row(fact: Fact, rng: random.Random) -> dict:
    """One question in the cais/mmlu schema: random distractors, random answer position."""
    choices = rng.sample(fact.pool, 3)
    answer = rng.randrange(4)
    choices.insert(answer, fact.answer)
    return {"question": fact.question, "subject": fact.subject, "choices": choices, "answer": answer}


def _key(row: dict) -> tuple:
    return (row["subject"], row["question"], tuple(row["choices"]))


def subject_title(subject: str) -> str:
    return subject.replace("_", " ")


def format_question(row: dict, with_answer: bool) -> str:
    lines = [row["question"].strip()]
    lines += [f"{letter}. {choice}" for letter, choice in zip(LETTERS, row["choices"])]
    text = "\n".join(lines) + "\nAnswer:"
    return text + f" {LETTERS[row['answer']]}" if with_answer else text


def format_prompt(row: dict, shots: Sequence[dict] = ()) -> str:
    """lm-evaluation-harness MMLU prompt, ending at "Answer:" (the model's next token is " X")."""
    header = f"The following are multiple choice questions (with answers) about {subject_title(row['subject'])}.\n\n"
    body = "".join(format_question(s, with_answer=True) + "\n\n" for s in shots)
    return header + body + format_question(row, with_answer=False)


class TaskGenerator:
    """Test/dev splits plus an endless stream of training rows that never repeat them."""

    def __init__(self, seed: int, n_test: int, n_dev_per_subject: int = 5, n_invented: int = 32):
        if n_test < len(SUBJECTS) or n_test % len(SUBJECTS):
            raise ValueError(f"n_test must be a positive multiple of {len(SUBJECTS)}, got {n_test}")
        if n_dev_per_subject < 1:
            raise ValueError(f"n_dev_per_subject must be >= 1, got {n_dev_per_subject}")
        self.seed = seed
        self.facts = build_facts(seed, n_invented)
        self.by_subject = {s: [f for f in self.facts if f.subject == s] for s in SUBJECTS}
        rng = random.Random(f"splits-{seed}")
        self.test: list[dict] = []
        self.dev: list[dict] = []
        for s in SUBJECTS:
            facts = list(self.by_subject[s])
            rng.shuffle(facts)
            # Test covers the subject's facts round-robin; dev uses the same facts, new instances.
            self.test += [make_row(facts[i % len(facts)], rng) for i in range(n_test // len(SUBJECTS))]
            self.dev += [make_row(facts[-1 - i % len(facts)], rng) for i in range(n_dev_per_subject)]
        self._held_out = {_key(r) for r in self.test + self.dev}
        self._train_rng = random.Random(f"train-{seed}")

    def training_row(self, subject: str | None = None) -> dict:
        rng = self._train_rng
        facts = self.facts if subject is None else self.by_subject[subject]
        while True:
            row = make_row(rng.choice(facts), rng)
            if _key(row) not in self._held_out:
                return row

    def training_text(self, n_shots: int) -> tuple[str, list[str]]:
        """A prompt with `n_shots` solved questions before the final one, and its answers' letters.

        Returns (full text including every " X" answer, [letter of each question in order]).
        """
        subject = self._train_rng.choice(SUBJECTS)
        rows = [self.training_row(subject) for _ in range(n_shots + 1)]
        text = format_prompt(rows[-1], rows[:-1]) + f" {LETTERS[rows[-1]['answer']]}"
        return text, [LETTERS[r["answer"]] for r in rows]

    def corpus(self, n_prompts: int) -> list[str]:
        """Plain text for the tokenizer and calibration: fact sentences and solved prompts."""
        texts = [f.statement for f in self.facts]
        for i in range(n_prompts):
            texts.append(self.training_text(i % 3)[0])
        return texts


def write_mmlu(directory: str, test: list[dict], dev: list[dict]) -> None:
    """Write the split as cais/mmlu jsonl and as the original MMLU CSV layout."""
    os.makedirs(directory, exist_ok=True)
    for split, rows in (("test", test), ("dev", dev)):
        with open(os.path.join(directory, f"{split}.jsonl"), "w", encoding="utf-8") as f:
            for r in sorted(rows, key=lambda r: r["subject"]):  # alphabetical, like cais "all"
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
        csv_dir = os.path.join(directory, "data", split)
        os.makedirs(csv_dir, exist_ok=True)
        for s in sorted(SUBJECTS):
            with open(os.path.join(csv_dir, f"{s}_{split}.csv"), "w", encoding="utf-8", newline="") as f:
                w = csv.writer(f)
                for r in rows:
                    if r["subject"] == s:
                        w.writerow([r["question"], *r["choices"], LETTERS[r["answer"]]])


def read_csv_split(directory: str, split: str) -> list[dict]:
    """Read `<directory>/data/<split>/<subject>_<split>.csv` files back into cais rows."""
    csv_dir = os.path.join(directory, "data", split)
    rows = []
    for name in sorted(os.listdir(csv_dir)):
        if not name.endswith(f"_{split}.csv"):
            continue
        subject = name[: -len(f"_{split}.csv")]
        with open(os.path.join(csv_dir, name), encoding="utf-8", newline="") as f:
            for rec in csv.reader(f):
                if len(rec) != 6 or rec[5] not in LETTERS:
                    raise ValueError(f"{name}: bad MMLU CSV row {rec!r}")
                rows.append({"question": rec[0], "subject": subject, "choices": rec[1:5],
                             "answer": LETTERS.index(rec[5])})
    return rows


def read_jsonl(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def write_calib(path: str, texts: Iterable[str]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for t in texts:
            f.write(json.dumps({"text": t}, ensure_ascii=False) + "\n")
