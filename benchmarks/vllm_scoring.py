"""The vLLM smoke's two choice-scoring methods side by side, in one vLLM engine (CPU or GPU).

    .venv/bin/python benchmarks/vllm_scoring.py RUN_DIR [--questions N] [--repeats 2] [--out FILE]

RUN_DIR is a pipeline run with mmlu/results.json and export/<name>/ (e.g. a recipe=none run of
the tiny or the SmolLM2 example).  The gate's questions are rebuilt exactly as the smoke does
(``launcher.vllm.gate_questions``); one offline engine (``launcher/vllm/offline_engine.py``'s
``score``, the product code) loads the export once, warms up, then times
``prompt_logprobs`` (one request per question and choice, prompt logprobs of prompt + choice)
and ``choice_logprobs`` (one request per question, logprobs of the four ids at the prompt's end)
alternately, ``--repeats`` times each.  Prints the best time of each, the ratio, the peak RSS
after each method's first pass, and the largest difference between the two methods' numbers.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

INNER = r"""
import importlib.util, json, os, resource, sys, time
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
spec = importlib.util.spec_from_file_location("offline_engine", sys.argv[1])
eng = importlib.util.module_from_spec(spec); spec.loader.exec_module(eng)
work = json.load(open(sys.argv[2]))
from vllm import LLM
llm = LLM(model=work["model"], enforce_eager=True, distributed_executor_backend="uni")
eng.score(llm, "choice_logprobs", work["prompts"][:8], work["choice_ids"])      # warm-up
out = {"seconds": {"prompt_logprobs": [], "choice_logprobs": []}, "peak_rss_mib": {}}
scores = {}
for rep in range(work["repeats"]):
    for method in ("choice_logprobs", "prompt_logprobs"):
        t = time.monotonic()
        scores[method] = eng.score(llm, method, work["prompts"], work["choice_ids"])
        out["seconds"][method].append(round(time.monotonic() - t, 3))
        if rep == 0:
            out["peak_rss_mib"][method] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
out["max_abs_diff"] = max(abs(a - b) for ra, rb in zip(scores["prompt_logprobs"], scores["choice_logprobs"])
                          for a, b in zip(ra, rb))
print("RESULT " + json.dumps(out), flush=True)
os._exit(0)
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir")
    ap.add_argument("--questions", type=int, default=0, help="0: all the gate's questions")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", help="write the result JSON here too")
    args = ap.parse_args()

    from omegaconf import OmegaConf

    from launcher.schema import PipelineConfig
    from launcher.mmlu.prepared import load_tokenizer
    from launcher.vllm.gate_questions import load_gate_set
    from launcher.vllm.probe import probe_platform, vllm_env, vllm_python
    from launcher.vllm.server import OFFLINE_SCRIPT

    cfg = OmegaConf.merge(OmegaConf.structured(PipelineConfig),
                          OmegaConf.load(os.path.join(args.run_dir, "config.yaml")))
    model = cfg.stages.vllm_smoke.model_dir or os.path.join(args.run_dir, "export", cfg.stages.export.name)
    gate = load_gate_set(os.path.join(args.run_dir, "mmlu", "results.json"), cfg.stages.mmlu,
                         load_tokenizer(cfg.model.path), args.questions)
    python = vllm_python(cfg.stages.vllm_smoke.python)
    platform = probe_platform(python)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"model": model, "prompts": gate.token_ids, "choice_ids": gate.choice_ids,
                   "repeats": args.repeats}, f)
        work = f.name
    try:
        proc = subprocess.run([python, "-c", INNER, OFFLINE_SCRIPT, work], capture_output=True, text=True,
                              env=vllm_env(device=platform.vllm_device))
    finally:
        os.remove(work)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        print(proc.stdout[-3000:], proc.stderr[-3000:], file=sys.stderr)
        return 1
    res = json.loads(line[len("RESULT "):])
    n = len(gate.token_ids)
    tokens = sum(len(t) for t in gate.token_ids)
    best = {m: min(s) for m, s in res["seconds"].items()}
    res.update(model=model, questions=n, prompt_tokens=tokens, vllm=platform.vllm_version,
               device=platform.vllm_device, best_s=best,
               ratio_prompt_over_choice=round(best["prompt_logprobs"] / best["choice_logprobs"], 2))
    print(f"{n} questions, {tokens} prompt tokens, {model} (vLLM {platform.vllm_version}, {platform.vllm_device})")
    print(f"{'method':<16} {'best s':>8} {'questions/s':>12} {'peak RSS MiB':>13}  all runs")
    for m in ("choice_logprobs", "prompt_logprobs"):
        print(f"{m:<16} {best[m]:>8.2f} {n / best[m]:>12.1f} {res['peak_rss_mib'][m]:>13}  {res['seconds'][m]}")
    print(f"prompt_logprobs / choice_logprobs time: {res['ratio_prompt_over_choice']}x; "
          f"largest difference between their log-probabilities: {res['max_abs_diff']:.3g}")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
