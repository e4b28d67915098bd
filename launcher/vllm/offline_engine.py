"""Offline vLLM engine: load a model, greedy-complete prompts, write JSON.  A standalone script.

Run by path in the vLLM interpreter (it imports nothing from ``launcher``, so it works in a
container python that lacks the project):

    python offline_engine.py --model DIR --prompts IN.json --out OUT.json [--tp N]
                             [--max-tokens N] [-- extra engine args: --max-model-len 512 ...]

IN.json: a list of prompt strings.  OUT.json: {"texts": [...], "load_s", "generate_s",
"vllm_version"} or {"error": "Type: message", "traceback": "..."} (exit code 2).
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=4)
    args, extra = ap.parse_known_args(argv)
    extra = [e for e in extra if e != "--"]
    result: dict = {}
    code = 0
    try:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        with open(args.prompts) as f:
            prompts = json.load(f)
        t0 = time.monotonic()
        import vllm
        from vllm import LLM, SamplingParams

        kwargs = dict(model=args.model, enforce_eager=True, tensor_parallel_size=args.tp,
                      distributed_executor_backend="uni" if args.tp == 1 else "mp")
        kwargs.update(engine_kwargs(extra))
        llm = LLM(**kwargs)
        result["load_s"] = round(time.monotonic() - t0, 2)
        result["vllm_version"] = getattr(vllm, "__version__", None)
        t1 = time.monotonic()
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, seed=0)
        outs = llm.generate(prompts, params, use_tqdm=False)
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
