"""vLLM smoke stage: serve the export with vLLM, ask it questions with known answers, score them.

Rank 0 does the work (run the stage with one process: vLLM spawns its own tensor-parallel
workers from ``parallel.tp``).  Steps:
  1. the export: <run_dir>/export/<stages.export.name>/ (an HF checkpoint);
  2. capability check (unless ``force``): the export's quantization vs. what vLLM offers in the
     chosen interpreter (``launcher.vllm.capability``).  Unsupported -> ``on_unsupported``:
     ``skip`` writes vllm_smoke/skip.json {reason} (the pipeline records it in metadata.json) and
     says so on the console; ``fail`` fails the stage;
  3. vLLM out of process - the OpenAI server on 127.0.0.1:<free port> (``mode: server``) or the
     offline engine in a subprocess (``mode: offline``) - logging to vllm_smoke/log.txt;
  4. greedy completions (temperature 0, ``max_tokens``) for the questions (``launcher.vllm.questions``);
  5. vllm_smoke/responses.json; the stage passes only if vLLM came up, every answer is
     non-empty and accuracy over the scored questions >= ``min_accuracy``.
vLLM is always stopped (process group + children), also on SIGTERM.  On failure the console
shows the last lines of the vLLM log and vLLM's own error line.
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from typing import Iterator, Optional

from omegaconf import OmegaConf

from launcher.stages.context import StageContext, StageFailed, write_json_atomic
from launcher.vllm import capability, questions as smoke_q
from launcher.vllm.probe import probe_platform, vllm_python
from launcher.vllm.procs import log_tail
from launcher.vllm.server import VllmError, VllmServer, run_offline

LOG_TAIL_LINES = 30


def _model_dir(ctx: StageContext) -> str:
    explicit = ctx.stage_cfg.model_dir
    return explicit or ctx.path("export", str(ctx.cfg.stages.export.name))


def _questions(ctx: StageContext) -> tuple[list[smoke_q.SmokeQuestion], str]:
    sc = ctx.stage_cfg
    try:
        if sc.prompts:
            return smoke_q.jsonl_questions(str(sc.prompts)), f"jsonl:{sc.prompts}"
        dataset = OmegaConf.select(ctx.cfg, "stages.mmlu.dataset", default=None)
        if not dataset:
            raise ValueError("stages.vllm_smoke.prompts is unset and stages.mmlu.dataset is missing: "
                             "nothing to ask")
        return smoke_q.mmlu_questions(str(dataset), int(sc.questions)), f"mmlu:{dataset}"
    except (OSError, ValueError) as e:
        raise StageFailed(f"vllm_smoke questions: {e}") from e


@contextlib.contextmanager
def _sigterm_as_exit() -> Iterator[None]:
    """SIGTERM (the executor cancelling us) unwinds through ``finally`` so vLLM gets stopped."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise SystemExit(128 + signum)

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def _show_tail(ctx: StageContext, log_path: str) -> None:
    tail = log_tail(log_path, LOG_TAIL_LINES)
    print(f"[vllm_smoke] last {len(tail)} lines of {log_path}:", file=sys.stderr)
    for ln in tail:
        print(f"  | {ln}", file=sys.stderr)
    sys.stderr.flush()


def _unsupported(ctx: StageContext, reason: str, record: dict) -> None:
    sc = ctx.stage_cfg
    if sc.on_unsupported == "fail":
        raise StageFailed(f"vLLM cannot serve this export here: {reason} "
                          f"(stages.vllm_smoke.on_unsupported=fail; force=true tries anyway)")
    write_json_atomic(os.path.join(ctx.stage_dir, "skip.json"), {"reason": reason, **record})
    ctx.warn(f"SKIPPED: {reason} (stages.vllm_smoke.on_unsupported=skip; force=true tries anyway)")


def run(ctx: StageContext) -> None:
    if ctx.rank != 0:
        return
    t_start = time.monotonic()
    sc = ctx.stage_cfg
    if sc.mode not in ("server", "offline"):
        raise StageFailed(f"stages.vllm_smoke.mode={sc.mode!r}: valid modes are server, offline")
    if sc.on_unsupported not in ("skip", "fail"):
        raise StageFailed(f"stages.vllm_smoke.on_unsupported={sc.on_unsupported!r}: valid: skip, fail")
    os.makedirs(ctx.stage_dir, exist_ok=True)
    for stale in ("responses.json", "skip.json"):
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(ctx.stage_dir, stale))
    log_path = os.path.join(ctx.stage_dir, "log.txt")
    model_dir = _model_dir(ctx)
    tp = int(sc.parallel.tp)

    try:
        quant = capability.read_quant_info(model_dir)
    except capability.ExportConfigError as e:
        raise StageFailed(f"vllm_smoke: no export to serve: {e} (run stages.export first)") from e
    python = vllm_python(sc.python)
    t0 = time.monotonic()
    platform = probe_platform(python)
    ok, reason = capability.decide(quant, platform, capability.read_model_info(model_dir))
    cap = {"ok": ok, "reason": reason, "forced": bool(sc.force), "quantization": quant.describe(),
           "python": python, "vllm_version": platform.vllm_version, "vllm_device": platform.vllm_device,
           "gpu_capabilities": [f"{a}.{b}" for a, b in platform.gpu_capabilities],
           "check_s": round(time.monotonic() - t0, 2)}
    ctx.log(f"export {model_dir}: {quant.describe()}; vLLM: {python} -> {reason}")
    if not ok and not sc.force:
        _unsupported(ctx, reason, {"capability": cap, "model_dir": model_dir})
        return
    if not ok:
        ctx.warn(f"capability check says no ({reason}); force=true: starting vLLM anyway")

    qs, source = _questions(ctx)
    prompts = [q.prompt for q in qs]
    extra = [str(a) for a in sc.extra_args]
    record = {"passed": False, "mode": sc.mode, "model_dir": model_dir, "source": source,
              "min_accuracy": float(sc.min_accuracy), "max_tokens": int(sc.max_tokens),
              "capability": cap, "server": None, "failure": None, "vllm_error": None}
    timings: dict = {"capability_s": cap["check_s"]}
    ctx.log(f"{sc.mode}: {len(qs)} questions from {source}, tp={tp}, log {log_path}")
    responses: Optional[list[str]] = None
    try:
        with _sigterm_as_exit():
            if sc.mode == "server":
                server = VllmServer(python, model_dir, log_path, tp=tp, extra_args=extra,
                                    device=platform.vllm_device,
                                    startup_timeout_s=float(sc.startup_timeout_s))
                try:
                    server.start()
                    ctx.log(f"server healthy at {server.base_url} after {server.startup_s:.1f} s")
                    t1 = time.monotonic()
                    responses = server.complete(prompts, int(sc.max_tokens), float(sc.request_timeout_s))
                    timings["generate_s"] = round(time.monotonic() - t1, 2)
                finally:
                    server.stop()
                    record["server"] = server.info()
                timings["startup_s"] = server.startup_s
            else:
                responses, info = run_offline(
                    python, model_dir, prompts, int(sc.max_tokens), log_path, ctx.stage_dir, tp=tp,
                    extra_args=extra, device=platform.vllm_device,
                    timeout_s=float(sc.startup_timeout_s) + float(sc.request_timeout_s))
                record["server"] = info
                timings["startup_s"], timings["generate_s"] = info.get("load_s"), info.get("generate_s")
    except VllmError as e:
        record.update(failure=str(e), vllm_error=e.error_line)
        record["server"] = record["server"] or e.info
        timings["total_s"] = round(time.monotonic() - t_start, 2)
        record["timings"] = timings
        write_json_atomic(os.path.join(ctx.stage_dir, "responses.json"), record)
        _show_tail(ctx, log_path)
        raise StageFailed(f"vllm_smoke: {e}") from e

    summary = smoke_q.summarize(qs, responses)
    record.update(summary)
    acc, n_scored = summary["accuracy"], summary["n_scored"]
    problems = smoke_q.verdict(summary, float(sc.min_accuracy))
    record["passed"] = not problems
    record["failure"] = "; ".join(problems) or None
    timings["total_s"] = round(time.monotonic() - t_start, 2)
    record["timings"] = timings
    write_json_atomic(os.path.join(ctx.stage_dir, "responses.json"), record)
    acc_s = f"{acc:.3f} ({summary['n_correct']}/{n_scored})" if acc is not None else "n/a (nothing scored)"
    ctx.log(f"accuracy {acc_s}, min {float(sc.min_accuracy):g}; {len(qs)} answers, "
            f"{len(summary['empty_responses'])} empty; {timings}")
    if acc is None:
        ctx.warn("no question has an expected answer: only 'non-empty' was checked")
    if problems:
        _show_tail(ctx, log_path)
        bad = [r for r in summary["questions"] if r["correct"] is False or not r["response"].strip()]
        for r in bad[:5]:
            ctx.warn(f"{r['id']}: expected {r['expected'] or r['contains']!r}, got {r['response']!r}")
        raise StageFailed(f"vllm_smoke failed: {record['failure']} "
                          f"(see {os.path.join(ctx.stage_dir, 'responses.json')})")
