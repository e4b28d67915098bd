"""Offline vLLM engine: load a model once, score choices and greedy-complete prompts, write JSON.

A standalone script, run by path in the vLLM interpreter (it imports nothing from ``launcher``,
so it works in a container python that lacks the project):

    python offline_engine.py --model DIR --work IN.json --out OUT.json [--tp N]
                             [-- extra engine args: --max-model-len 512 ...]

IN.json (token ids throughout: vLLM does not re-tokenize)::

    {"score": {"method": "prompt_logprobs" | "choice_logprobs", "prompts": [[ids]],
               "choice_ids": [a, b, c, d]} | null,
     "generate": {"prompts": [[ids]], "max_tokens": N} | null}

The two scoring methods are those of ``launcher.vllm.client`` (same SamplingParams, so server
and offline mode compute the same numbers).  OUT.json: {"choice_logprobs": [[4 floats]],
"texts": [...], "load_s", "score_s", "generate_s", "vllm_version"} or {"error": "Type:
message", "traceback": "..."} (exit code 2).
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import sys
import time
import traceback


def engine_kwargs(extra: list[str]) -> dict:
    """['--max-model-len', '512', '--trust-remote-code'] -> {'max_model_len': 512, 'trust_remote_code': True}."""
    out: dict = {}
    i = 0
    while i < len(extra):
        tok = extra[i]
        if not tok.startswith("--"):
            raise SystemExit(f"offline_engine: unexpected argument {tok!r} (engine args are --key [value])")
        key, sep, val = tok[2:].partition("=")
        if not sep and (i + 1 >= len(extra) or extra[i + 1].startswith("--")):
            val = "true"
        elif not sep:
            i += 1
            val = extra[i]
        try:
            value = ast.literal_eval(val)
        except (ValueError, SyntaxError):
            value = {"true": True, "false": False}.get(val.lower(), val)
        out[key.replace("-", "_")] = value
        i += 1
    return out


def score(llm, method: str, prompts: list, choice_ids: list) -> list:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    if method == "prompt_logprobs":
        params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
        reqs = [TokensPrompt(prompt_token_ids=list(p) + [int(c)]) for p in prompts for c in choice_ids]
        outs = llm.generate(reqs, params, use_tqdm=False)
        k = len(choice_ids)
        return [[outs[i * k + j].prompt_logprobs[-1][int(c)].logprob for j, c in enumerate(choice_ids)]
                for i in range(len(prompts))]
    if method == "choice_logprobs":
        params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=len(choice_ids),
                                logprob_token_ids=[int(c) for c in choice_ids])
        outs = llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params,
                            use_tqdm=False)
        return [[o.outputs[0].logprobs[0][int(c)].logprob for c in choice_ids] for o in outs]
    raise ValueError(f"unknown scoring method {method!r}: valid: prompt_logprobs, choice_logprobs")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tp", type=int, default=1)
    args, extra = ap.parse_known_args(argv)
    extra = [e for e in extra if e != "--"]
    result: dict = {}
    code = 0
    try:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        with open(args.work) as f:
            work = json.load(f)
        t0 = time.monotonic()
        import vllm
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        kwargs = dict(model=args.model, enforce_eager=True, tensor_parallel_size=args.tp,
                      distributed_executor_backend="uni" if args.tp == 1 else "mp")
        kwargs.update(engine_kwargs(extra))
        llm = LLM(**kwargs)
        result["load_s"] = round(time.monotonic() - t0, 2)
        result["vllm_version"] = getattr(vllm, "__version__", None)
        if work.get("score"):
            sc = work["score"]
            t1 = time.monotonic()
            print(f"[offline_engine] scoring {len(sc['prompts'])} prompts ({sc['method']})", flush=True)
            result["choice_logprobs"] = score(llm, sc["method"], sc["prompts"], sc["choice_ids"])
            result["score_s"] = round(time.monotonic() - t1, 2)
        if work.get("generate"):
            gen = work["generate"]
            t1 = time.monotonic()
            print(f"[offline_engine] generating for {len(gen['prompts'])} prompts", flush=True)
            params = SamplingParams(temperature=0.0, max_tokens=int(gen["max_tokens"]), seed=0)
            outs = llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in gen["prompts"]],
                                params, use_tqdm=False)
            result["texts"] = [o.outputs[0].text if o.outputs else "" for o in outs]
            result["generate_s"] = round(time.monotonic() - t1, 2)
    except BaseException as e:  # noqa: BLE001 - everything is reported to the stage
        result = {"error": f"{type(e).__name__}: {e}".strip(), "traceback": traceback.format_exc()}
        print(result["traceback"], file=sys.stderr, flush=True)
        code = 2
    tmp = args.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, args.out)
    sys.stdout.flush()
    os._exit(code)   # skip vLLM's slow/fragile interpreter teardown


if __name__ == "__main__":
    main()
