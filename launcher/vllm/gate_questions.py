"""The gate's questions, rebuilt exactly as the gate scored them (worker side: loads a tokenizer).

``mmlu/results.json`` lists, in the gate's order, each question's dataset index and subject, the
gate's prediction and its four choice logits; it does not store prompts.  They are rebuilt here by
the gate's own code (``launcher.mmlu.prepared.prepare``) from ``stages.mmlu``'s config and the
gate's tokenizer (``model.path``): the same questions in the same order (``fraction``), the same
shots (``few_shots``, ``dev_dataset``), the same BOS rule (``add_bos``), the same left truncation
(``max_seq_len``) and the same choice token ids (the last token of " A".." D").  The rebuilt list
must match results.json question for question (subject and index) and in its recorded settings;
otherwise results.json came from another config, and comparing would be meaningless.

The smoke then sends these token ids to vLLM as they are (no re-tokenization on the vLLM side).
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from launcher.vllm.agreement import GateAnswer, gate_answer, pick

# results.json settings that must equal stages.mmlu's for the prompts to be the gate's
_SETTINGS = ("dataset", "dev_dataset", "fraction", "few_shots", "add_bos")


class GateMismatch(ValueError):
    """results.json does not describe the questions stages.mmlu's config selects."""


@dataclass
class GateSet:
    answers: list[GateAnswer]
    token_ids: list[list[int]]      # per question: the prompt exactly as the gate fed it
    choice_ids: list[int]           # token ids of " A" .. " D"
    info: dict                      # what responses.json records about the source


def read_results(path: str) -> dict:
    try:
        with open(path) as f:
            doc = json.load(f)
    except FileNotFoundError as e:
        raise GateMismatch(f"{path} not found: the smoke compares vLLM with the gate's per-question "
                           f"results (run stages.mmlu first, or set stages.vllm_smoke.score_choices="
                           f"false to run the generation checks only)") from e
    except (OSError, json.JSONDecodeError) as e:
        raise GateMismatch(f"{path}: unreadable ({e})") from e
    if not isinstance(doc, dict) or not isinstance(doc.get("questions"), list):
        raise GateMismatch(f"{path}: no 'questions' list (not an mmlu/results.json)")
    return doc


def load_gate_set(results_path: str, mmlu_cfg, tokenizer, n: int) -> GateSet:
    """The gate's questions (``n`` of them evenly spaced in the gate's order; 0: all)."""
    from launcher.mmlu.prepared import prepare

    doc = read_results(results_path)
    for key in _SETTINGS:
        if key in doc and doc[key] != _plain(mmlu_cfg[key]):
            raise GateMismatch(f"{results_path} was made with stages.mmlu.{key}={doc[key]!r} but the "
                               f"config now says {mmlu_cfg[key]!r}: rerun stages.mmlu")
    prepared = prepare(mmlu_cfg, tokenizer)
    entries = doc["questions"]
    ours = [(p.question.subject, p.question.index) for p in prepared.prompts]
    theirs = [(e.get("subject"), e.get("index")) for e in entries]
    if ours != theirs:
        first = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
        raise GateMismatch(f"{results_path} lists {len(theirs)} questions, stages.mmlu selects "
                           f"{len(ours)}; they differ from position {first} on: rerun stages.mmlu")
    if "truncated_prompts" in doc and doc["truncated_prompts"] != prepared.truncated:
        raise GateMismatch(f"{results_path}: the gate truncated {doc['truncated_prompts']} prompts, the "
                           f"rebuilt prompts truncate {prepared.truncated} (stages.mmlu.max_seq_len changed?)")
    keep = pick(len(entries), n)
    answers = [gate_answer(entries[i], f"{theirs[i][0]}/{theirs[i][1]}") for i in keep]
    info = {"results": results_path, "n_gate": len(entries), "selected": len(keep),
            "gate_accuracy_all": doc.get("accuracy"), "lower_bound": doc.get("lower_bound"),
            "choice_token_ids": list(prepared.choice_ids),
            **{k: doc.get(k) for k in _SETTINGS}, "truncated_prompts": prepared.truncated}
    return GateSet(answers=answers, token_ids=[list(prepared.token_ids[i]) for i in keep],
                   choice_ids=list(prepared.choice_ids), info=info)


def _plain(value):
    from omegaconf import OmegaConf

    return OmegaConf.to_container(value) if OmegaConf.is_config(value) else value
