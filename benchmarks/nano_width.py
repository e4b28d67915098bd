"""Nemotron-3-Nano-30B-A3B at its real width on one GPU: what each pipeline stage costs.

    python3 benchmarks/nano_width.py --out $OUT/nano_width.json                 # pattern MEM*E
    python3 benchmarks/nano_width.py --out $OUT/nano_width.json --patterns MEM*E,13   # + Nano's first 13 layers

For each ``--patterns`` entry (a layer pattern such as ``MEM*E``, or a number N: the first N layers
of the card's own pattern) it
  1. builds a random ``NemotronHForCausalLM`` whose widths are read from the Nano card
     (examples/nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16/config.json: hidden, attention heads and
     KV heads, Mamba-2 heads/groups/state, 128 routed experts top-6 plus the shared expert, relu2,
     untied embeddings), with the pattern cut to the given layers and the vocabulary of the Qwen
     tokenizer in ``.bench/qwen-tokenizer`` (151,665 tokens, rounded up to a multiple of 128);
     bf16 weights, built on the GPU and saved as safetensors;
  1b. with ``--train-steps N``, trains it for N steps on the gate's own questions
     (benchmarks/_answer_training.py: decisive choices, so the vLLM smoke's agreement measures the
     serving, not a random model's near-ties), and saves it again;
  2. runs the product on it: ``launch`` of the Nano example on ``executor.device`` at world size 1
     (quantize NVFP4 with ``--calib-size`` samples of ``--calib-len`` tokens of MMLU text, the MMLU
     gate on ``--fraction`` of ``.bench/mmlu/test.jsonl``, export), the gate's bound set to 0 (a
     random model: the figures are cost, not quality);
  3. reports per stage: wall time (metadata.json) and the stage's own breakdown (quantize/summary.json,
     mmlu/results.json, export/verify.json timings), peak GPU memory (nvidia-smi sampled every
     0.2 s), export throughput (parameters per second of ``export_s``) and the gate's MFU (useful
     FLOPs = 2 x active non-embedding parameters per real token, over ``eval_s``, against the
     H200's dense bf16 datasheet peak), and where the export's time goes: rank 0's cProfile summary
     (``--profile``, the launcher's PTQ_PROFILE; launcher/profiling.py).
The JSON is rewritten after each pattern, so a run cut off by a time limit keeps what it measured.
A markdown table goes to stdout.  The extrapolation to the full Nano is paper: benchmarks/README.md.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._common import (MMLU_JSONL, QWEN_TOKENIZER, REPO_ROOT, copy_tokenizer, log,  # noqa: E402
                                markdown_table, read_jsonl, read_stage_figures, write_json)

CARD = os.path.join(REPO_ROOT, "examples/nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16/config.json")
NANO = "examples/nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16/megatron_lm_ptq.yaml"
H200_BF16_DENSE_FLOPS = 989.4e12          # datasheet, dense (no sparsity)
# card keys that are not NemotronHConfig arguments or that the benchmark sets itself
_NOT_CONFIG = {"architectures", "model_type", "num_hidden_layers", "hybrid_override_pattern", "vocab_size"}


def read_card(path: str = CARD) -> dict:
    with open(path) as f:
        return json.load(f)


def resolve_pattern(spec: str, card_pattern: str) -> str:
    """``MEM*E`` -> itself; ``13`` -> the first 13 layers of the card's pattern."""
    if spec.isdigit():
        n = int(spec)
        if not 1 <= n <= len(card_pattern):
            raise ValueError(f"--patterns: {n} layers asked, the card's pattern has {len(card_pattern)}")
        return card_pattern[:n]
    bad = set(spec) - set("ME*-")
    if bad:
        raise ValueError(f"--patterns: {spec!r} has {sorted(bad)}; valid layer letters: M (Mamba-2), "
                         f"E (MoE), * (attention), - (MLP)")
    return spec


def nano_config(card: dict, pattern: str, vocab: int, tokenizer) -> "object":
    """The NemotronHConfig of the card with ``pattern`` as its layers and ``vocab`` tokens."""
    from transformers import NemotronHConfig

    kwargs = {k: v for k, v in card.items() if k not in _NOT_CONFIG}
    return NemotronHConfig(**kwargs, vocab_size=vocab, hybrid_override_pattern=pattern,
                           num_hidden_layers=len(pattern), conv_kernel=4, chunk_size=128,
                           max_position_embeddings=4096, use_cache=False,
                           bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                           pad_token_id=tokenizer.pad_token_id, dtype="bfloat16")


def param_counts(model, top_k: int, n_experts: int) -> dict:
    """Total, routed-expert and active non-embedding parameters (per token)."""
    total = experts = embed = 0
    for name, p in model.named_parameters():
        n = p.numel()
        total += n
        if ".experts." in name:
            experts += n
        if "embeddings" in name or "embed_tokens" in name:
            embed += n
    active = total - embed - experts + experts * top_k // n_experts
    return {"total": total, "routed_experts": experts, "embedding": embed, "active_non_embedding": active}


# what one pattern writes under --work, in units of its bf16 checkpoint: the source itself, quantize's
# Megatron checkpoint (the bf16 weights again) and the NVFP4 export (0.43-0.45x measured), rounded up
DISK_PER_BF16_BYTE = 2.5


class NotEnoughDisk(RuntimeError):
    pass


def check_disk(work: str, params: int, free: int | None = None) -> int:
    """Refuse a pattern whose files would not fit under ``work`` (the H200's 64 GiB disk filled on the
    13-layer pattern after two others, 2026-12-06); returns the bytes it needs."""
    need = int(2 * params * DISK_PER_BF16_BYTE)
    free = shutil.disk_usage(work).free if free is None else free
    if free < need:
        raise NotEnoughDisk(
            f"--work {work}: {free / 1e9:.1f} GB free, a {params / 1e9:.2f} B-parameter pattern needs about "
            f"{need / 1e9:.1f} GB ({DISK_PER_BF16_BYTE}x its {2 * params / 1e9:.1f} GB bf16 checkpoint: the "
            f"source, quantize's checkpoint, the export); remove earlier patterns' nano-N/ and runs/nano-width-N/ "
            f"there, or give another --work")
    return need


def build_model(out: str, card: dict, pattern: str, device: str, seed: int = 0) -> dict:
    import torch
    import transformers

    copy_tokenizer(QWEN_TOKENIZER, out)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    vocab = (len(tok) + 127) // 128 * 128
    config = nano_config(card, pattern, vocab, tok)
    with torch.device("meta"):
        planned = param_counts(transformers.NemotronHForCausalLM(config), card["num_experts_per_tok"],
                               card["n_routed_experts"])
    check_disk(os.path.dirname(out), planned["total"])
    torch.manual_seed(seed)
    t = time.perf_counter()
    with torch.device(device):
        model = transformers.NemotronHForCausalLM(config).to(torch.bfloat16).eval()
    build_s = time.perf_counter() - t
    counts = param_counts(model, card["num_experts_per_tok"], card["n_routed_experts"])
    t = time.perf_counter()
    model.save_pretrained(out, max_shard_size="2GB")
    save_s = time.perf_counter() - t
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return {"pattern": pattern, "layers": len(pattern), "vocab": vocab, "tokenizer_tokens": len(tok),
            "params": counts, "build_s": build_s, "save_s": save_s,
            "bytes_bf16": sum(os.path.getsize(p) for p in glob.glob(os.path.join(out, "*.safetensors")))}


def train_saved_model(hf: str, launch: list[str], args) -> dict:
    """The saved random model trained on the gate's own questions (``benchmarks/_answer_training.py``:
    decisive choices, so a served export's agreement with the gate measures serving, not noise), saved
    again in place; the stage config is the launch's own (``launch`` is its argv)."""
    import torch
    import transformers

    from benchmarks._answer_training import prompts_for, train_answers
    from launcher.config.compose import compose_example

    cfg = compose_example(os.path.join(REPO_ROOT, NANO), launch[launch.index(NANO) + 1:])
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf)
    prompts = prompts_for(cfg.stages.mmlu, tokenizer)
    # float32 master weights: an AdamW step is ~lr, under a bf16 weight's spacing (2^-13 near the init's
    # 0.02) for lr <= 1e-4; trained in bf16 at batch 1, lr 5e-4, the model learned one letter for all
    # 168 questions (an H100, 2026-12-07: argmax C everywhere). Saved in bf16 again (the buffers, such
    # as the router's fp32 score-correction bias, stay as they were loaded).
    model = transformers.NemotronHForCausalLM.from_pretrained(hf, dtype=torch.float32, device_map=args.device)
    torch.backends.cuda.matmul.allow_tf32 = True    # the training's float32 matmuls on tensor cores
    figures = train_answers(model, prompts, args.train_steps, args.train_lr, args.train_batch, log=log,
                            until_accuracy=args.train_until or None)
    for p in model.parameters():
        p.data = p.data.to(torch.bfloat16)
    t = time.perf_counter()
    model.save_pretrained(hf, max_shard_size="2GB")
    figures["save_s"] = round(time.perf_counter() - t, 2)
    del model
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return figures


class GpuMemorySampler:
    """Peak ``memory.used`` of GPU 0 by nvidia-smi, sampled on a thread (MiB)."""

    def __init__(self, period_s: float = 0.2):
        self.period_s, self.peak_mib, self._stop = period_s, 0, threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits",
                                      "-i", "0"], capture_output=True, text=True, timeout=5).stdout
                self.peak_mib = max(self.peak_mib, int(out.strip().splitlines()[0]))
            except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
                pass
            self._stop.wait(self.period_s)

    def __enter__(self) -> "GpuMemorySampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def write_calibration(path: str, n: int) -> str:
    """``n`` calibration texts of MMLU questions, long enough to fill ``--calib-len`` tokens."""
    rows = read_jsonl(MMLU_JSONL)
    with open(path, "w") as f:
        for i in range(n):
            block = [rows[(i * 37 + j) % len(rows)] for j in range(12)]
            text = "\n\n".join(r["question"] + "\n" + "\n".join(f"{l}. {c}" for l, c in zip("ABCD", r["choices"]))
                               for r in block)
            f.write(json.dumps({"text": text}) + "\n")
    return path


def derived(fig: dict, model: dict) -> dict:
    out = {}
    e, m = fig.get("export") or {}, fig.get("mmlu") or {}
    if e.get("export_s"):
        out["export_params_per_s"] = model["params"]["total"] / e["export_s"]
    if m.get("eval_s") and m.get("real_tokens"):
        flops = 2 * model["params"]["active_non_embedding"] * m["real_tokens"]
        out["gate_tokens_per_s"] = m["real_tokens"] / m["eval_s"]
        out["gate_mfu_datasheet"] = flops / m["eval_s"] / H200_BF16_DENSE_FLOPS
    return out


def run_launch(cmd: list[str], timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
    """``cmd`` in the repo, its output captured; past ``timeout`` seconds it and every process it started
    (the stage's ranks, vLLM's engine) are killed and the exit is recorded as ``"timeout"``, with the
    output so far, so the report keeps the pattern's other figures instead of the script dying on an
    uncaught TimeoutExpired (or on the caller's outer ``timeout``) with nothing written.  The launch
    stays in this process group, so an outer ``timeout`` still reaches it."""
    p = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        out, err = p.communicate(timeout=timeout)
        return subprocess.CompletedProcess(cmd, p.returncode, out, err)
    except subprocess.TimeoutExpired:
        kill_tree(p)
        try:
            out, err = p.communicate(timeout=30)
        except subprocess.TimeoutExpired:          # a descendant we could not find still holds the pipes
            out, err = "", ""
        return subprocess.CompletedProcess(cmd, "timeout", out or "",
                                           (err or "") + f"\n[nano_width] killed after {timeout:.0f} s (--timeout)")


def kill_tree(p: subprocess.Popen) -> None:
    """SIGKILL ``p`` and its descendants (psutil, on the GPU image; without it, ``p`` alone)."""
    try:
        import psutil
        procs = psutil.Process(p.pid).children(recursive=True)
    except Exception:  # noqa: BLE001 - no psutil, or p already gone: p alone
        procs = []
    for proc in procs:
        try:
            proc.kill()
        except Exception:  # noqa: BLE001 - gone already
            pass
    p.kill()


def launch_argv(hf: str, pattern: str, model: dict, calib: str, runs_root: str, job: str, args,
                smoke: list[str]) -> list[str]:
    """``launch`` of the Nano example on the built model at world size 1; ``smoke``: the vLLM smoke's overrides."""
    one = "{tp:1,pp:1,ep:1,etp:1,world_size:1}"
    return [sys.executable, "-m", "launcher.cli", NANO, f"model.path={hf}", f"model.num_layers={len(pattern)}",
            f"model.hybrid_pattern={pattern}", f"model.vocab_size={model['vocab']}", "model.trust_remote_code=false",
            f"stages.quantize.calib.dataset={calib}", f"stages.quantize.calib.size={args.calib_size}",
            f"stages.quantize.calib.max_seq_len={args.calib_len}", f"stages.quantize.parallel={one}",
            f"stages.mmlu.parallel={one}", f"stages.export.parallel={one}", f"stages.mmlu.dataset={MMLU_JSONL}",
            f"stages.mmlu.fraction={args.fraction}", "stages.mmlu.lower_bound=0.0",
            *smoke, f"executor.device={args.device}", f"runs_root={runs_root}", f"job_name={job}", *args.overrides]


def completed_run(runs_root: str, job: str) -> str | None:
    """The newest run of ``job`` whose pipeline completed (an earlier call's, kept under ``--work``)."""
    for run in sorted(glob.glob(os.path.join(runs_root, job, "*")), key=os.path.getmtime, reverse=True):
        try:
            with open(os.path.join(run, "metadata.json")) as f:
                if json.load(f).get("status") == "completed":
                    return run
        except (OSError, ValueError):
            continue
    return None


def recorded_launch(path: str, fresh: list[str]) -> list[str]:
    """The ``launch`` argv a run was made with, recorded at ``path`` when it was made; ``fresh`` when
    none was.  A later call on the host may run from another copy of the repo (gpu_background.sh
    gives each job its own), so the MMLU file's path in a fresh argv can differ, and ``--resume``
    with another path would redo the gate and then refuse to overwrite the export."""
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return fresh


def smoke_argv(base: list[str], python: str, run: str, nvfp4_kernels: str = "auto",
               mode: str = "offline") -> list[str]:
    """The pipeline's ``launch`` argv with the vLLM smoke enabled (``mode``: offline or server, ``python``
    as vLLM's interpreter, failing where vLLM refuses, no accuracy floor: a random model, NVFP4 served
    by ``nvfp4_kernels``) resuming ``run``: the other stages' manifests still match, so only the smoke runs."""
    smoke = ["stages.vllm_smoke.enabled=true", f"stages.vllm_smoke.python={python}",
             "stages.vllm_smoke.on_unsupported=fail", f"stages.vllm_smoke.mode={mode}",
             "stages.vllm_smoke.min_accuracy=0.0", f"stages.vllm_smoke.nvfp4_kernels={nvfp4_kernels}"]
    return [a for a in base if not a.startswith("stages.vllm_smoke.enabled=")] + smoke + ["--resume", run]


def _stat(path: str) -> tuple | None:
    try:
        st = os.stat(path)
        return st.st_mtime_ns, st.st_ino, st.st_size
    except FileNotFoundError:
        return None


def serve_with_vllm(base: list[str], run: str, args) -> dict:
    """The vLLM smoke (offline mode, ``--vllm`` interpreter) on the run's export, by ``launch --resume``,
    once per ``--vllm-kernels`` choice (vLLM's own, and its NVFP4 emulation: the export at its own
    precision), in each ``--vllm-modes`` mode: each one's verdict, or vLLM's own error when it does not
    serve the export. Keys: the kernels choice (offline), ``auto-server`` (server mode)."""
    served = {}
    for mode, kernels in ((m, k) for m in args.vllm_modes.split(",") for k in args.vllm_kernels.split(",")):
        kind = kernels if mode == "offline" else f"{kernels}-{mode}"
        cmd = smoke_argv(base, args.vllm, run, kernels, mode)
        log(f"  vLLM ({kind}): " + " ".join(cmd))
        files = {name: os.path.join(run, "vllm_smoke", name) for name in ("responses.json", "skip.json")}
        before = {name: _stat(path) for name, path in files.items()}
        t = time.perf_counter()
        p = run_launch(cmd, args.timeout)
        out = {"exit": p.returncode, "wall_s": time.perf_counter() - t}
        for name, path in files.items():
            # this launch's own files only: a launch that failed or timed out before writing its verdict
            # would otherwise report the previous kernels' (e.g. auto's, before emulation's)
            if os.path.exists(path) and _stat(path) != before[name]:
                with open(path) as f:
                    doc = json.load(f)
                stem = name.split(".")[0]
                out[stem] = {k: doc.get(k) for k in (
                    "passed", "failure", "failures", "agreement", "accuracy", "gate_accuracy", "vllm_error",
                    "kernels", "timings", "capability", "reason", "criteria")}
                if isinstance(doc.get("choices"), dict):    # the comparison with the gate, less its questions
                    out[stem]["choices"] = {k: v for k, v in doc["choices"].items() if k != "questions"}
                # kept per kind: the next kind's launch writes the same files again
                shutil.copy(path, os.path.join(run, "vllm_smoke", f"{stem}-{kind}.json"))
        engine_log = os.path.join(run, "vllm_smoke", "log.txt")
        if os.path.exists(engine_log):
            shutil.copy(engine_log, os.path.join(run, "vllm_smoke", f"log-{kind}.txt"))
        if p.returncode != 0:
            out["error_tail"] = p.stdout[-2000:] + "\n" + p.stderr[-3000:]
        log(f"  vLLM ({kind}): exit {p.returncode}, agreement {(out.get('responses') or {}).get('agreement')}")
        served[kind] = out
    return served


def trained_suffix(args) -> str:
    """What names a trained model's folder and job (``-trained300x4-lr0.0002-until0.9``; "" untrained): a
    model trained otherwise is another model, so a later call on the host never reuses it in its place."""
    if not args.train_steps:
        return ""
    until = f"-until{args.train_until:g}" if args.train_until else ""
    return f"-trained{args.train_steps}x{args.train_batch}-lr{args.train_lr:g}{until}"


def ready_model(model_json: str, args) -> dict | None:
    """The figures of a model an earlier call on this host built (and, when ``args.train_steps``, trained
    and saved again) whose launch did not complete, so that a call cut off by its time limit loses only
    the launch; None where there is none, or where its training did not finish (it is built again)."""
    if not os.path.exists(model_json):
        return None
    with open(model_json) as f:
        model = json.load(f)
    return model if not args.train_steps or "answers" in model else None


def run_pattern(spec: str, card: dict, work: str, args) -> dict:
    pattern = resolve_pattern(spec, card["hybrid_override_pattern"])
    trained = trained_suffix(args)
    hf = os.path.join(work, f"nano-{len(pattern)}{trained}")
    runs_root = os.path.join(work, "runs")
    job = f"nano-width-{len(pattern)}{trained}"
    calib = os.path.join(work, "calib.jsonl")
    model_json = os.path.join(hf, "nano_width_model.json")
    launch_json = os.path.join(work, f"{job}.launch.json")
    # an earlier call on this host (--work kept) built (and trained) the model, and perhaps ran it
    model = ready_model(model_json, args)
    earlier = completed_run(runs_root, job) if model else None
    if earlier:
        log(f"pattern {pattern}: reusing {earlier}")
        base = recorded_launch(launch_json, launch_argv(hf, pattern, model, calib, runs_root, job, args,
                                                        ["stages.vllm_smoke.enabled=false"]))
        entry = {"spec": spec, "model": model, "run_dir": earlier, "exit": 0, "reused": True,
                 "stages": read_stage_figures(earlier)}
        entry.update(derived(entry["stages"], model))
    else:
        if model:                                  # built (and trained) by an earlier call cut off in its launch
            log(f"pattern {pattern}: reusing the model in {hf}" + (" (trained)" if args.train_steps else ""))
        else:
            log(f"pattern {pattern}: building the model in {hf}")
            try:
                model = build_model(hf, card, pattern, args.device)
            except NotEnoughDisk as e:
                log(f"  refused: {e}")
                return {"spec": spec, "model": {"pattern": pattern, "params": {"total": 0}}, "exit": "no disk",
                        "error": str(e)}
            write_json(model_json, model)
            log(f"  {model['params']['total'] / 1e9:.2f} B parameters, {model['bytes_bf16'] / 1e9:.1f} GB, "
                f"built {model['build_s']:.1f} s, saved {model['save_s']:.1f} s")
        write_calibration(calib, args.calib_size)
        base = launch_argv(hf, pattern, model, calib, runs_root, job, args, ["stages.vllm_smoke.enabled=false"])
        if args.train_steps and "answers" not in model:
            model["answers"] = train_saved_model(hf, base, args)
            write_json(model_json, model)
        write_json(launch_json, base)
        log("  " + " ".join(base))
        t = time.perf_counter()
        with GpuMemorySampler() as mem:
            p = run_launch(base, args.timeout, env={**os.environ, "PTQ_PROFILE": args.profile})
        wall = time.perf_counter() - t
        runs = sorted(glob.glob(os.path.join(runs_root, job, "*")), key=os.path.getmtime)
        entry = {"spec": spec, "model": model, "launch_wall_s": wall, "exit": p.returncode,
                 "peak_gpu_memory_mib": mem.peak_mib}
        if p.returncode != 0:
            entry["error_tail"] = (p.stdout[-2000:] + "\n" + p.stderr[-3000:])
        if runs:
            entry["run_dir"] = runs[-1]
            entry["stages"] = read_stage_figures(runs[-1])
            entry.update(derived(entry["stages"], model))
            entry["profiles"] = read_profiles(runs[-1], args.profile)
    if args.vllm and entry["exit"] == 0:
        entry["vllm_smoke"] = serve_with_vllm(base, entry["run_dir"], args)
    return entry


def read_profiles(run: str, stages: str, lines: int = 70) -> dict:
    """Rank 0's PTQ_PROFILE summary (launcher/profiling.py) of each profiled stage: its first ``lines``
    lines (the costliest functions by cumulative time) and the file's path for the rest."""
    out = {}
    for stage in filter(None, stages.split(",")):
        path = os.path.join(run, stage, "profile-rank0.txt")
        if os.path.exists(path):
            with open(path) as f:
                out[stage] = {"path": path, "top": f.read().splitlines()[:lines]}
    return out


def table(results: list[dict]) -> str:
    rows = []
    for r in results:
        s = r.get("stages") or {}
        q, m, e = s.get("quantize") or {}, s.get("mmlu") or {}, s.get("export") or {}
        rows.append([r["model"]["pattern"], f"{r['model']['params']['total'] / 1e9:.2f} B", q.get("wall_s"),
                     q.get("calibrate_and_quantize_s"), m.get("wall_s"), m.get("eval_s"), e.get("wall_s"),
                     e.get("export_s"), e.get("verify_s"), f"{r.get('export_params_per_s', 0) / 1e6:.1f}",
                     f"{r.get('gate_mfu_datasheet', 0):.4f}", r.get("peak_gpu_memory_mib"), r["exit"]])
    return markdown_table(["pattern", "params", "quantize s", "calib+quant s", "gate s", "gate eval s",
                           "export s", "export write s", "verify s", "export M params/s", "gate MFU",
                           "peak GPU MiB", "exit"], rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--patterns", default="MEM*E", help="comma-separated: a layer pattern, or N = the card's first N")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--calib-size", type=int, default=8)
    ap.add_argument("--calib-len", type=int, default=512)
    ap.add_argument("--fraction", type=float, default=0.01)
    ap.add_argument("--timeout", type=int, default=900, help="per launch, seconds")
    ap.add_argument("--work", help="folder for the models and runs (default: a new temporary one); a pattern "
                    "whose run completed there is reused, not rebuilt")
    ap.add_argument("--vllm", metavar="PYTHON", help="then serve each export with vLLM (the smoke, offline "
                    "mode, this interpreter) by launch --resume, and report its verdict or vLLM's error")
    ap.add_argument("--vllm-kernels", default="auto,emulation",
                    help="comma-separated stages.vllm_smoke.nvfp4_kernels values to serve with (default: both)")
    ap.add_argument("--vllm-modes", default="offline",
                    choices=("offline", "server", "offline,server", "server,offline"),
                    help="the smoke's modes, each with every --vllm-kernels choice (default offline)")
    ap.add_argument("--profile", default="export", help="PTQ_PROFILE for the pipeline: the stages whose rank 0 "
                    "profile summary goes into the report (default export: where the writer's time goes; '' for none)")
    ap.add_argument("--train-steps", type=int, default=0, help="train the random model on the gate's own "
                    "questions for this many steps before the launch (0: random; benchmarks/_answer_training.py)")
    ap.add_argument("--train-lr", type=float, default=5e-4)
    ap.add_argument("--train-batch", type=int, default=2, help="prompts per step (2 in float32 trained on the "
                    "H100 (80 GB, 2026-12-07); 8 in bf16 ran out of it: transformers' reference Mamba-2 scan without "
                    "mamba_ssm's CUDA extension materialises chunk x chunk x heads x state per sequence)")
    ap.add_argument("--train-until", type=float, default=0.9, help="stop training at the first check (every "
                    "50 steps) whose accuracy on the gate's questions reaches this (0: run every --train-steps)")
    ap.add_argument("overrides", nargs="*", help="extra launch overrides")
    args = ap.parse_args(argv)
    card = read_card()
    specs = args.patterns.split(",")
    for s in specs:                          # refuse a bad spec before building anything
        resolve_pattern(s, card["hybrid_override_pattern"])
    if args.train_steps < 0 or args.train_batch < 1 or args.train_lr <= 0 or not 0 <= args.train_until <= 1:
        ap.error(f"--train-steps {args.train_steps} must be >= 0, --train-batch {args.train_batch} >= 1, "
                 f"--train-lr {args.train_lr} > 0 and --train-until {args.train_until} in [0, 1]")
    doc = {"benchmark": "nano_width", "card": os.path.relpath(CARD, REPO_ROOT), "args": vars(args), "results": []}
    work = args.work or tempfile.mkdtemp(prefix="bench-nano-")
    os.makedirs(work, exist_ok=True)
    for spec in specs:
        doc["results"].append(run_pattern(spec, card, work, args))
        write_json(args.out, {**doc, "complete": False})
        print(table(doc["results"]), flush=True)
    doc["complete"] = True
    write_json(args.out, doc)
    return 0 if all(r["exit"] == 0 for r in doc["results"]) else 1


if __name__ == "__main__":
    sys.exit(main())
