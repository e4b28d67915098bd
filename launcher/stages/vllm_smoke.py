"""vLLM smoke stage: serve the export with vLLM, ask it questions with known answers, score them.

Rank 0 does the work (run the stage with one process: vLLM spawns its own tensor-parallel
workers from ``parallel.tp``).  Steps:
  1. the export: <run_dir>/export/<stages.export.name>/ (an HF checkpoint);
  2. capability check (unless ``force``): the export's quantization vs. what vLLM offers in the
     chosen interpreter (``launcher.vllm.capability``).  Unsupported -> ``on_unsupported``:
     ``skip`` writes vllm_smoke/skip.json {reason} (the pipeline records it in metadata.json) and
     says so on the console; ``fail`` fails the stage;
  3. vLLM out of process (``launcher.vllm.backends``: the OpenAI server, ``mode: server``, or the
     offline engine in a subprocess, ``mode: offline``), logging to vllm_smoke/log.txt;
  4. greedy completions (temperature 0, ``max_tokens``) for the questions (``launcher.vllm.questions``);
  5. vllm_smoke/responses.json (``SmokeRecord``); the stage passes only if vLLM came up, every
     answer is non-empty and accuracy over the scored questions >= ``min_accuracy``.
vLLM is always stopped (process group + children), also on SIGTERM.  On failure the console
shows the last lines of the vLLM log and vLLM's own error line.
Config values (mode, on_unsupported, ...) are checked by ``launcher.config.validate._check_vllm``.
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Iterator, Optional

from omegaconf import OmegaConf

from launcher.stages.context import StageContext, StageFailed, write_json_atomic
from launcher.vllm import capability, questions as smoke_q
from launcher.vllm.backends import BACKENDS, Backend
from launcher.vllm.probe import probe_platform, vllm_python
from launcher.vllm.procs import log_tail
from launcher.vllm.server import VllmError

LOG_TAIL_LINES = 30


@dataclass
class SmokeRecord:
    """The content of vllm_smoke/responses.json."""

    mode: str
    model_dir: str
    source: str
    min_accuracy: float
    max_tokens: int
    capability: dict
    passed: bool = False
    server: Optional[dict] = None
    failure: Optional[str] = None
    vllm_error: Optional[str] = None
    summary: dict = field(default_factory=dict)     # questions.summarize
    timings: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(d.pop("summary"))
        return d


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


def _show_tail(log_path: str) -> None:
    tail = log_tail(log_path, LOG_TAIL_LINES)
    print(f"[vllm_smoke] last {len(tail)} lines of {log_path}:", file=sys.stderr)
    for ln in tail:
        print(f"  | {ln}", file=sys.stderr)
    sys.stderr.flush()


def _capability(ctx: StageContext, model_dir: str) -> tuple[dict, str]:
    """The capability record and the device of the vLLM build; StageFailed without an export."""
    try:
        quant = capability.read_quant_info(model_dir)
    except capability.ExportConfigError as e:
        raise StageFailed(f"vllm_smoke: no export to serve: {e} (run stages.export first)") from e
    python = vllm_python(ctx.stage_cfg.python)
    t0 = time.monotonic()
    platform = probe_platform(python)
    ok, reason = capability.decide(quant, platform)
    ctx.log(f"export {model_dir}: {quant.describe()}; vLLM: {python} -> {reason}")
    return {"ok": ok, "reason": reason, "forced": bool(ctx.stage_cfg.force),
            "quantization": quant.describe(), "python": python,
            "vllm_version": platform.vllm_version, "vllm_device": platform.vllm_device,
            "gpu_capabilities": [f"{a}.{b}" for a, b in platform.gpu_capabilities],
            "check_s": round(time.monotonic() - t0, 2)}, platform.vllm_device


def _refused(ctx: StageContext, cap: dict, model_dir: str) -> bool:
    """True when the stage ends here: the export is unsupported and ``force`` is off (skip or fail)."""
    if cap["ok"]:
        return False
    if ctx.stage_cfg.force:
        ctx.warn(f"capability check says no ({cap['reason']}); force=true: starting vLLM anyway")
        return False
    if ctx.stage_cfg.on_unsupported == "fail":
        raise StageFailed(f"vLLM cannot serve this export here: {cap['reason']} "
                          f"(stages.vllm_smoke.on_unsupported=fail; force=true tries anyway)")
    write_json_atomic(os.path.join(ctx.stage_dir, "skip.json"),
                      {"reason": cap["reason"], "capability": cap, "model_dir": model_dir})
    ctx.warn(f"SKIPPED: {cap['reason']} (stages.vllm_smoke.on_unsupported=skip; force=true tries anyway)")
    return True


def _backend(ctx: StageContext, model_dir: str, python: str, device: str) -> Backend:
    sc = ctx.stage_cfg
    return BACKENDS[sc.mode](python=python, model_dir=model_dir,
                             log_path=os.path.join(ctx.stage_dir, "log.txt"), work_dir=ctx.stage_dir,
                             tp=int(sc.parallel.tp), extra_args=[str(a) for a in sc.extra_args],
                             device=device, startup_timeout_s=float(sc.startup_timeout_s),
                             request_timeout_s=float(sc.request_timeout_s))


def _write(ctx: StageContext, record: SmokeRecord, t_start: float) -> None:
    record.timings["total_s"] = round(time.monotonic() - t_start, 2)
    write_json_atomic(os.path.join(ctx.stage_dir, "responses.json"), record.to_dict())


def _report(ctx: StageContext, record: SmokeRecord, problems: list[str]) -> None:
    s = record.summary
    acc = s["accuracy"]
    acc_s = f"{acc:.3f} ({s['n_correct']}/{s['n_scored']})" if acc is not None else "n/a (nothing scored)"
    ctx.log(f"accuracy {acc_s}, min {record.min_accuracy:g}; {s['n']} answers, "
            f"{len(s['empty_responses'])} empty; {record.timings}")
    if acc is None:
        ctx.warn("no question has an expected answer: only 'non-empty' was checked")
    if problems:
        bad = [r for r in s["questions"] if r["correct"] is False or not r["response"].strip()]
        for r in bad[:5]:
            ctx.warn(f"{r['id']}: expected {r['expected'] or r['contains']!r}, got {r['response']!r}")


def run(ctx: StageContext) -> None:
    if ctx.rank != 0:
        return
    t_start = time.monotonic()
    sc = ctx.stage_cfg
    os.makedirs(ctx.stage_dir, exist_ok=True)
    for stale in ("responses.json", "skip.json"):
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(ctx.stage_dir, stale))
    model_dir = _model_dir(ctx)
    cap, device = _capability(ctx, model_dir)
    if _refused(ctx, cap, model_dir):
        return
    qs, source = _questions(ctx)
    record = SmokeRecord(mode=sc.mode, model_dir=model_dir, source=source,
                         min_accuracy=float(sc.min_accuracy), max_tokens=int(sc.max_tokens),
                         capability=cap, timings={"capability_s": cap["check_s"]})
    backend = _backend(ctx, model_dir, cap["python"], device)
    ctx.log(f"{sc.mode}: {len(qs)} questions from {source}, tp={sc.parallel.tp}, log {backend.log_path}")
    try:
        with _sigterm_as_exit():
            texts, record.server = backend.generate([q.prompt for q in qs], int(sc.max_tokens))
    except VllmError as e:
        record.failure, record.vllm_error, record.server = str(e), e.error_line, e.info or None
        _write(ctx, record, t_start)
        _show_tail(backend.log_path)
        raise StageFailed(f"vllm_smoke: {e}") from e
    record.timings.update(startup_s=record.server.get("startup_s"),
                          generate_s=record.server.get("generate_s"))
    record.summary = smoke_q.summarize(qs, texts)
    problems = smoke_q.verdict(record.summary, record.min_accuracy)
    record.passed, record.failure = not problems, "; ".join(problems) or None
    _write(ctx, record, t_start)
    _report(ctx, record, problems)
    if problems:
        _show_tail(backend.log_path)
        raise StageFailed(f"vllm_smoke failed: {record.failure} "
                          f"(see {os.path.join(ctx.stage_dir, 'responses.json')})")
