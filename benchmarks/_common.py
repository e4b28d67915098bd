"""Helpers shared by the benchmark scripts (not product code; nothing here is imported by launcher/).

* ``run_on_ranks`` - re-exported from ``launcher_testing.ranks``: run ``module:function`` on
  N local gloo ranks as subprocesses, collect each rank's JSON result; kill the ranks on timeout.
* ``single_rank_env`` - the env:// variables for a world of one inside this process.
* ``write_random_qwen3_moe`` / ``write_model_dir`` - HF checkpoint dirs (config.json + tokenizer
  files; weights only when asked) for benchmarks that use random weights.
* ``make_mmlu_hf_dir`` / ``check_mmlu_hf_dir`` - a local HF datasets dir (``all/test-*.parquet``
  plus a README.md declaring config ``all``) that ``datasets.load_dataset(dir, "all",
  split="test")`` - what ModelOpt's ``megatron_mmlu`` calls - can load offline.
* ``markdown_table``, ``median_wall``, ``write_json``.
"""
from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from typing import Optional, Sequence

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH_DIR = os.path.join(REPO_ROOT, ".bench")
MMLU_JSONL = os.path.join(BENCH_DIR, "mmlu", "test.jsonl")
MMLU_HF_DIR = os.path.join(BENCH_DIR, "mmlu_hf")
QWEN_TOKENIZER = os.path.join(BENCH_DIR, "qwen-tokenizer")

if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

# The rank launcher the tests use (N gloo ranks as subprocesses, timeout, per-rank JSON results).
from launcher_testing.ranks import free_port, run_on_ranks  # noqa: E402,F401


# ----------------------------------------------------------------------------------- processes

def single_rank_env() -> None:
    """env:// rendezvous variables for world size 1 in this process (kept when already set)."""
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))


def median_wall(cmd: Sequence[str], runs: int = 3, cwd: str = REPO_ROOT, env: Optional[dict] = None,
                timeout_s: float = 600) -> dict:
    """Wall seconds of ``cmd`` as a subprocess: median, min, all runs (fails on a non-zero exit)."""
    walls = []
    for _ in range(runs):
        t = time.perf_counter()
        p = subprocess.run(list(cmd), cwd=cwd, env={**os.environ, **(env or {})}, capture_output=True,
                           text=True, timeout=timeout_s)
        walls.append(time.perf_counter() - t)
        if p.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} exited {p.returncode}:\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
    return {"median_s": statistics.median(walls), "min_s": min(walls), "runs_s": walls}


# -------------------------------------------------------------------------------------- models

def copy_tokenizer(src: str, dst: str) -> None:
    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(src):
        p = os.path.join(src, name)
        if os.path.isfile(p) and name != "config.json" and not name.endswith((".safetensors", ".bin")):
            shutil.copy2(p, os.path.join(dst, name))


def write_model_dir(out: str, config: dict, tokenizer_dir: str) -> str:
    """A checkpoint directory with ``config.json`` and the tokenizer files (no weights)."""
    copy_tokenizer(tokenizer_dir, out)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return out


def train_small_tokenizer(out: str, texts: Sequence[str], vocab: int = 1024) -> str:
    """The tiny model's BPE tokenizer recipe (launcher_testing.tiny.tokenizer) trained on ``texts``."""
    from launcher_testing.tiny.tokenizer import train_tokenizer

    tok = train_tokenizer(texts, vocab)
    tok.save_pretrained(out)
    return out


def write_random_qwen3_moe(out: str, tokenizer_dir: str, hidden: int = 128, layers: int = 4,
                           heads: int = 4, kv_heads: int = 2, head_dim: int = 32, experts: int = 8,
                           top_k: int = 2, moe_ffn: int = 128, seed: int = 0,
                           max_positions: int = 4096) -> str:
    """A random Qwen3-MoE HF checkpoint (fp32 safetensors) with the tokenizer of ``tokenizer_dir``."""
    import transformers

    from launcher_testing.checkpoints import write_qwen3_moe_weights

    copy_tokenizer(tokenizer_dir, out)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    vocab = ((len(tok) + 127) // 128) * 128
    eos = tok.eos_token_id if tok.eos_token_id is not None else 0
    return write_qwen3_moe_weights(out, vocab, eos, hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads,
                                   head_dim=head_dim, ffn=4 * hidden, moe_ffn=moe_ffn, experts=experts,
                                   top_k=top_k, max_positions=max_positions, seed=seed)


def read_stage_figures(run_dir: str) -> dict:
    """Per stage: status and wall (metadata.json) plus the stage's own timings."""
    meta = json.load(open(os.path.join(run_dir, "metadata.json")))
    out = {s: {"status": st.get("status"), "wall_s": st.get("duration_s")} for s, st in (meta.get("stages") or {}).items()}
    for stage, name in (("quantize", "summary.json"), ("mmlu", "results.json"), ("export", "verify.json")):
        p = os.path.join(run_dir, stage, name)
        if os.path.isfile(p):
            doc = json.load(open(p))
            out.setdefault(stage, {}).update(doc.get("timings") or {})
            if stage == "mmlu":
                plan = doc.get("plan") or {}
                padded = sum(plan.get("padded_tokens_per_rank") or [0])
                out["mmlu"].update(n=doc.get("n"), accuracy=doc.get("accuracy"),
                                   real_tokens=round(padded * (doc.get("padding_efficiency_with_plan") or 0)))
    return out


# ----------------------------------------------------------------------------------- MMLU data

_README = """---
configs:
- config_name: all
  data_files:
  - split: test
    path: all/test-*.parquet
---
# MMLU test split (cais/mmlu schema), local copy for the benchmarks

Built by benchmarks/_common.py make_mmlu_hf_dir from {src}.
`datasets.load_dataset(<this dir>, "all", split="test")` loads it offline.
"""


def read_jsonl(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def make_mmlu_hf_dir(jsonl: str = MMLU_JSONL, out: str = MMLU_HF_DIR, force: bool = False) -> str:
    """``out/all/test-00000-of-00001.parquet`` + ``out/README.md`` from a cais-schema jsonl."""
    target = os.path.join(out, "all", "test-00000-of-00001.parquet")
    if os.path.isfile(target) and os.path.isfile(os.path.join(out, "README.md")) and not force:
        return out
    import datasets

    rows = read_jsonl(jsonl)
    features = datasets.Features({
        "question": datasets.Value("string"),
        "subject": datasets.Value("string"),
        "choices": datasets.Sequence(datasets.Value("string")),
        "answer": datasets.ClassLabel(num_classes=4, names=["A", "B", "C", "D"]),
    })
    ds = datasets.Dataset.from_dict({
        "question": [r["question"] for r in rows],
        "subject": [r["subject"] for r in rows],
        "choices": [list(r["choices"]) for r in rows],
        "answer": [int(r["answer"]) for r in rows],
    }, features=features)
    os.makedirs(os.path.join(out, "all"), exist_ok=True)
    ds.to_parquet(target + ".tmp")
    os.replace(target + ".tmp", target)
    with open(os.path.join(out, "README.md"), "w") as f:
        f.write(_README.format(src=os.path.relpath(jsonl, REPO_ROOT)))
    return out


def check_mmlu_hf_dir(hf_dir: str = MMLU_HF_DIR, jsonl: str = MMLU_JSONL) -> int:
    """Load ``hf_dir`` exactly as megatron_mmlu does and assert it equals ``jsonl`` row by row."""
    import datasets

    ds = datasets.load_dataset(hf_dir, "all", split="test")
    rows = read_jsonl(jsonl)
    if len(ds) != len(rows):
        raise AssertionError(f"{hf_dir}: {len(ds)} rows, {jsonl}: {len(rows)}")
    for i, (a, b) in enumerate(zip(ds, rows)):
        if (a["question"], a["subject"], list(a["choices"]), int(a["answer"])) != (
                b["question"], b["subject"], list(b["choices"]), int(b["answer"])):
            raise AssertionError(f"row {i} differs between {hf_dir} and {jsonl}")
    return len(ds)


# ------------------------------------------------------------------------------------- output

def markdown_table(headers: Sequence[str], rows: Sequence[Sequence]) -> str:
    def fmt(v):
        if isinstance(v, float):
            return f"{v:,.3f}" if abs(v) < 100 else f"{v:,.1f}"
        return str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(fmt(v) for v in r) + " |" for r in rows]
    return "\n".join(lines)


def write_json(path: str, doc: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(doc, f, indent=2, default=str)
        f.write("\n")
    os.replace(path + ".tmp", path)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)
