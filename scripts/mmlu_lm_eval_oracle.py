"""lm-evaluation-harness as the oracle for the MMLU gate's numbers: same questions, same checkpoint.

    .venv/bin/python -m pip install lm-eval==0.4.13      # this script only; CI never needs it
    .venv/bin/python scripts/mmlu_lm_eval_oracle.py --mmlu ../shared/data/mmlu/test.jsonl \\
        --model "$(.venv/bin/python -m launcher_testing.models smollm2)" --out tests/golden/smollm2_mmlu_lm_eval.json

Split: the shared file is MMLU's test split only, so per subject (file order) the first 5
questions are the dev split (few-shot examples) and the rest are test questions.  Sets: 0-shot,
the first ``--zero-shot-per-subject`` test questions of every subject; 5-shot, the first test
question of the ``--five-shot-subjects`` subjects whose 5-shot prompt is shortest (CPU cost).

lm-eval side: its own ``mmlu`` task definition (the installed ``tasks/mmlu/default`` YAMLs:
description, doc_to_text, choices, ``first_n`` few-shot sampler), pointed at local jsonl files;
HF backend, float32, CPU, no hub.  Per question it gives the log-likelihood of " A" .. " D".
Our side: ``launcher.mmlu.prepared.prepare`` + ``launcher.mmlu.evaluate.evaluate_model`` (the
gate's code) on the Megatron model at world size 1, giving the four choice logits.
Compared per question: the prediction, and the per-choice scores centered on their mean
(log-likelihoods and logits differ by one log-sum-exp per question) within ``--tolerance``.

The golden file carries the questions (test and dev) and lm-eval's numbers, so that
tests/test_smollm2_layouts.py compares the gate against it on CI without ../shared or lm-eval.
Exit 1 when the comparison fails.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import OrderedDict

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

DEV_PER_SUBJECT = 5


def read_jsonl(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def write_jsonl(path: str, rows: list[dict]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def split(rows: list[dict]) -> "OrderedDict[str, tuple[list[dict], list[dict]]]":
    """subject -> (dev: first 5 in file order, test: the rest)."""
    by: OrderedDict[str, list[dict]] = OrderedDict()
    for r in rows:
        by.setdefault(r["subject"], []).append(
            {"question": r["question"], "subject": r["subject"], "choices": list(r["choices"]), "answer": int(r["answer"])})
    return OrderedDict((s, (qs[:DEV_PER_SUBJECT], qs[DEV_PER_SUBJECT:])) for s, qs in by.items())


def select_sets(parts, zero_per_subject: int, five_subjects: int) -> dict[str, list[dict]]:
    from launcher.mmlu.data import Question
    from launcher.mmlu.prompts import build_prompt

    def q(r, i):
        return Question(i, r["subject"], r["question"], tuple(r["choices"]), r["answer"])

    zero = [r for _, (_, test) in parts.items() for r in test[:zero_per_subject]]
    lengths = sorted((len(build_prompt(q(test[0], 0), [q(d, j) for j, d in enumerate(dev)])), s)
                     for s, (dev, test) in parts.items())
    chosen = {s for _, s in lengths[:five_subjects]}
    five = [test[0] for s, (_, test) in parts.items() if s in chosen]
    return {"0": zero, "5": five}


def lm_eval_task(subject: str, test_file: str, dev_file: str) -> dict:
    """lm-eval's own mmlu_<subject> task config (installed YAMLs), reading local jsonl."""
    import lm_eval
    import yaml

    root = os.path.join(os.path.dirname(lm_eval.__file__), "tasks", "mmlu", "default")
    with open(os.path.join(root, "_default_template_yaml")) as f:
        cfg = yaml.safe_load(f)
    with open(os.path.join(root, f"mmlu_{subject}.yaml")) as f:
        cfg.update({k: v for k, v in yaml.safe_load(f).items() if k not in ("include", "tag")})
    cfg.update(task=f"mmlu_local_{subject}", dataset_path="json", dataset_name=None,
               dataset_kwargs={"data_files": {"test": test_file, "dev": dev_file}})
    cfg.pop("task_alias", None)
    return cfg


def run_lm_eval(model_dir: str, questions: list[dict], dev: dict[str, list[dict]], shots: int, work: str,
                batch_size: int) -> list[dict]:
    """lm-eval's per-choice log-likelihoods for ``questions`` (in order)."""
    import lm_eval

    tasks, order = [], OrderedDict()
    for r in questions:
        order.setdefault(r["subject"], []).append(r)
    for subject, rows in order.items():
        test_file = os.path.join(work, f"lm_eval_{shots}_{subject}_test.jsonl")
        dev_file = os.path.join(work, f"lm_eval_{shots}_{subject}_dev.jsonl")
        write_jsonl(test_file, rows)
        write_jsonl(dev_file, dev[subject])
        tasks.append(lm_eval_task(subject, test_file, dev_file))
    out = lm_eval.simple_evaluate(
        model="hf", model_args={"pretrained": model_dir, "dtype": "float32", "device": "cpu"},
        tasks=tasks, num_fewshot=shots, batch_size=batch_size, log_samples=True, bootstrap_iters=0)
    by_subject = {}
    for subject in order:
        samples = sorted(out["samples"][f"mmlu_local_{subject}"], key=lambda s: s["doc_id"])
        by_subject[subject] = samples
    result = []
    for subject, rows in order.items():
        samples = by_subject[subject]
        assert len(samples) == len(rows), (subject, len(samples), len(rows))
        for r, s in zip(rows, samples):
            assert s["doc"]["question"] == r["question"], (subject, s["doc_id"])
            ll = [float(x[0]) for x in s["filtered_resps"]]
            result.append({"loglikelihoods": ll, "prediction": max(range(4), key=lambda i: ll[i])})
    return result


def run_ours(model_dir: str, test_file: str, dev_file: str, shots: int) -> list[dict]:
    """The gate's prepare + evaluate_model on the Megatron model (world size 1, this process)."""
    from omegaconf import OmegaConf

    from launcher.schema import MmluStage
    from launcher.megatron.dist import init_distributed, shutdown
    from launcher.megatron.hf_io import import_hf_weights
    from launcher.megatron.models import build_model
    from launcher.mmlu.evaluate import evaluate_model
    from launcher.mmlu.prepared import load_tokenizer, prepare
    from launcher.topology import ParallelDims

    scfg = OmegaConf.merge(OmegaConf.structured(MmluStage), {
        "dataset": test_file, "dev_dataset": dev_file if shots else None, "fraction": 1.0, "few_shots": shots,
        "batch_size": 8, "max_batch_tokens": 4096})
    prepared = prepare(scfg, load_tokenizer(model_dir))
    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}.items():
        os.environ.setdefault(k, v)
    if "MASTER_PORT" not in os.environ:
        from launcher.executors.local import free_port
        os.environ["MASTER_PORT"] = str(free_port())
    dims = ParallelDims(world_size=1)
    init_distributed(dims, "cpu", timeout_s=600)
    try:
        model = build_model(model_dir, dims, "cpu", "float32")
        import_hf_weights(model, model_dir, "float32")
        results, _, _ = evaluate_model(model, prepared, dims, 0, log=lambda m: print(f"[ours] {m}", flush=True))
    finally:
        shutdown()
    return [{"logits": results[i][1], "prediction": results[i][0]} for i in range(len(prepared.prompts))]


def centered(xs: list[float]) -> list[float]:
    m = sum(xs) / len(xs)
    return [x - m for x in xs]


def compare(lm: list[dict], ours: list[dict], tolerance: float) -> dict:
    diffs = [max(abs(a - b) for a, b in zip(centered(x["loglikelihoods"]), centered(y["logits"])))
             for x, y in zip(lm, ours)]
    margins = []
    for x in lm:
        top = sorted(x["loglikelihoods"], reverse=True)
        margins.append(top[0] - top[1])
    same = sum(x["prediction"] == y["prediction"] for x, y in zip(lm, ours))
    return {"n": len(lm), "predictions_equal": same, "max_centered_score_diff": max(diffs),
            "questions_over_tolerance": sum(d > tolerance for d in diffs), "tolerance": tolerance,
            "min_top2_margin_lm_eval": min(margins),
            "accuracy_lm_eval": None, "ok": same == len(lm) and max(diffs) <= tolerance}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mmlu", required=True, help="MMLU test split as jsonl (cais/mmlu schema)")
    p.add_argument("--model", required=True, help="HF checkpoint directory")
    p.add_argument("--out", required=True, help="golden JSON to write")
    p.add_argument("--zero-shot-per-subject", type=int, default=1)
    p.add_argument("--five-shot-subjects", type=int, default=15)
    p.add_argument("--tolerance", type=float, default=1e-3)
    p.add_argument("--batch-size", type=int, default=8)
    args = p.parse_args(argv)
    import lm_eval
    import torch
    import transformers

    t0 = time.time()
    parts = split(read_jsonl(args.mmlu))
    sets = select_sets(parts, args.zero_shot_per_subject, args.five_shot_subjects)
    dev = {s: d for s, (d, _) in parts.items()}
    used_dev = {s: dev[s] for s in OrderedDict((r["subject"], None) for r in sets["5"])}
    doc = {"command": "python scripts/mmlu_lm_eval_oracle.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "split": f"per subject, in file order: the first {DEV_PER_SUBJECT} questions are dev (few-shot), "
                    "the rest test", "source": os.path.basename(args.mmlu),
           "model_build": _build_info(args.model),
           "versions": {"lm_eval": lm_eval.__version__ if hasattr(lm_eval, "__version__") else None,
                        "transformers": transformers.__version__, "torch": torch.__version__},
           "dev": [r for rows in used_dev.values() for r in rows], "sets": {}}
    ok = True
    with tempfile.TemporaryDirectory(prefix="lm-eval-oracle-") as work:
        dev_file = os.path.join(work, "dev.jsonl")
        write_jsonl(dev_file, doc["dev"])
        for shots, questions in sets.items():
            k = int(shots)
            print(f"[oracle] {k}-shot: {len(questions)} questions", flush=True)
            test_file = os.path.join(work, f"test_{k}.jsonl")
            write_jsonl(test_file, questions)
            t = time.time()
            lm = run_lm_eval(args.model, questions, dev, k, work, args.batch_size)
            lm_s = time.time() - t
            t = time.time()
            ours = run_ours(args.model, test_file, dev_file, k)
            ours_s = time.time() - t
            cmp_ = compare(lm, ours, args.tolerance)
            cmp_["accuracy_lm_eval"] = sum(x["prediction"] == q["answer"] for x, q in zip(lm, questions)) / len(questions)
            cmp_["accuracy_ours"] = sum(y["prediction"] == q["answer"] for y, q in zip(ours, questions)) / len(questions)
            cmp_["seconds"] = {"lm_eval": round(lm_s, 1), "ours": round(ours_s, 1)}
            print(f"[oracle] {k}-shot: {json.dumps(cmp_)}", flush=True)
            ok &= cmp_["ok"]
            doc["sets"][shots] = {"few_shots": k, "questions": questions, "comparison": cmp_,
                                  "lm_eval": [{"loglikelihoods": x["loglikelihoods"], "prediction": x["prediction"]} for x in lm],
                                  "ours": ours}
    doc["seconds"] = round(time.time() - t0, 1)
    tmp = args.out + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    os.replace(tmp, args.out)
    print(f"[oracle] wrote {args.out}: {'OK' if ok else 'MISMATCH'}", flush=True)
    return 0 if ok else 1


def _build_info(model_dir: str) -> dict:
    path = os.path.join(model_dir, "build.json")
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        info = json.load(f)
    return {k: info.get(k) for k in ("model", "build_hash", "source", "dtype", "num_params")}


if __name__ == "__main__":
    sys.exit(main())
