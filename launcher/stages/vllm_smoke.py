"""vLLM smoke stage: serve the export with vLLM and check that it answers as the gate's model did.

The stage is one launcher rank; vLLM spawns its own tensor-parallel workers
(``tensor_parallel_size``).  Steps:
  1. the export: <run_dir>/export/<stages.export.name>/ (an HF checkpoint), or ``model_dir``;
  2. capability check (unless ``force``): the export's quantization vs. what vLLM offers in the
     chosen interpreter (``launcher.vllm.capability``).  Unsupported -> ``on_unsupported``:
     ``skip`` writes vllm_smoke/skip.json {reason} (the pipeline records it in metadata.json) and
     says so on the console; ``fail`` fails the stage;
  3. inputs, as token ids: the gate's questions rebuilt exactly as the gate scored them
     (``launcher.vllm.gate_questions``, checked against mmlu/results.json) and the generation
     checks of ``prompts`` (``launcher.vllm.generation``, the export's chat template applied);
  4. vLLM out of process, once (``launcher.vllm.backends``: the OpenAI server, ``mode: server``,
     or the offline engine in a subprocess, ``mode: offline``), logging to vllm_smoke/log.txt:
     the four choice log-probabilities per question (``scoring``), greedy completions per check;
  5. the verdict, in vllm_smoke/responses.json (``SmokeRecord``).  It passes only when
       * choices (``launcher.vllm.agreement``): agreement with the gate's predictions >=
         ``min_agreement`` over the questions whose gate top-2 margin is >= ``tie_margin``
         (the others are reported apart), and served accuracy >= ``min_accuracy``;
       * generation: every answer non-empty and every ``contains``/``expected`` holds.
vLLM is always stopped (process group + children), also on SIGTERM.  On failure the console
shows the last lines of the vLLM log and vLLM's own error line.
Config values (mode, scoring, bounds) are checked by ``launcher.config.validate._check_vllm``.
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import dataclasses
from dataclasses import asdict, dataclass, field
from typing import Iterator, Optional

from launcher.contract import StageFailed, write_json_atomic
from launcher.stages.context import StageContext
from launcher.stages.timings import Timings
from launcher.vllm import agreement, capability, generation, kernels
from launcher.vllm.backends import BACKENDS, Backend, Replies, Work
from launcher.vllm.gate_questions import GateMismatch, GateSet, load_gate_set
from launcher.vllm.probe import probe_platform, probe_quant, vllm_python
from launcher.vllm.procs import log_tail
from launcher.vllm.server import VllmError

LOG_TAIL_LINES = 30
SCORE_DEFINITION = "log-softmax over the four choice tokens (shift-invariant: comparable to the gate's raw logits)"


@dataclass
class Checks:
    """The generation checks, rendered for the served tokenizer."""
    source: str
    items: list[generation.GenerationCheck]
    token_ids: list[list[int]]
    rendered: list[str]
    chat: list[bool]


@dataclass
class SmokeRecord:
    """The content of vllm_smoke/responses.json."""

    mode: str
    model_dir: str
    capability: dict
    criteria: dict = field(default_factory=dict)
    passed: bool = False
    failure: Optional[str] = None           # the failures, joined
    failures: list[str] = field(default_factory=list)
    agreement: Optional[float] = None       # = choices.agreement, at the top for a quick look
    accuracy: Optional[float] = None        # = choices.accuracy
    choices: Optional[dict] = None          # source, totals, per-question rows, passed
    generation: Optional[dict] = None       # source, totals, per-prompt rows, passed
    server: Optional[dict] = None
    vllm_error: Optional[str] = None
    kernels: Optional[dict] = None          # vLLM's kernel choices, from its log (launcher.vllm.kernels)
    timings: dict = field(default_factory=dict)

    def judge(self, gate: Optional[GateSet], checks: Optional[Checks], replies: Replies) -> None:
        c = self.criteria
        if gate is not None:
            rows = agreement.compare(gate.answers, replies.choice_logprobs, c["tie_margin"])
            summary = agreement.summarize(rows, gate.answers)
            bad = agreement.verdict(summary, c["min_agreement"], c["min_accuracy"], c["tie_margin"])
            self.choices = {"source": gate.info, "scoring": c["scoring"], "score": SCORE_DEFINITION,
                            "passed": not bad, "failures": bad, **summary}
            self.agreement, self.accuracy = summary["agreement"], summary["accuracy"]
            self.failures += bad
        if checks is not None:
            summary = generation.summarize(checks.items, checks.rendered, checks.chat, replies.texts)
            bad = generation.verdict(summary)
            self.generation = {"source": checks.source, "max_tokens": c["max_tokens"],
                               "passed": not bad, "failures": bad, **summary}
            self.failures += bad
        self.passed = not self.failures
        self.failure = "; ".join(self.failures) or None


def _model_dir(ctx: StageContext) -> str:
    explicit = ctx.stage_cfg.model_dir
    return explicit or ctx.layout.export_dir(str(ctx.cfg.stages.export.name))


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


def _capability(ctx: StageContext, model_dir: str, timings: Timings) -> tuple[dict, capability.QuantInfo, str]:
    """(capability record, the export's quantization, the vLLM build's device); the check's seconds
    go to ``timings["capability_s"]`` and the record's ``check_s``."""
    try:
        quant = capability.read_quant_info(model_dir)
    except capability.ExportConfigError as e:
        raise StageFailed(f"vllm_smoke: no export to serve: {e} (run stages.export first)") from e
    python = vllm_python(ctx.stage_cfg.python)
    with timings.measure("capability_s"):
        platform = probe_platform(python)
        if platform.vllm_importable and platform.vllm_device == "cuda" and quant.quantized:
            # vLLM's own minimum capability for this checkpoint (its config class), not a table of ours
            platform = dataclasses.replace(platform, **probe_quant(python, model_dir))
        ok, reason = capability.decide(quant, platform, capability.read_model_info(model_dir))
    ctx.log(f"export {model_dir}: {quant.describe()}; vLLM: {python} -> {reason}")
    return {"ok": ok, "reason": reason, "forced": bool(ctx.stage_cfg.force),
            "quantization": quant.describe(), "python": python,
            "vllm_version": platform.vllm_version, "vllm_device": platform.vllm_device,
            "gpu_capabilities": [f"{a}.{b}" for a, b in platform.gpu_capabilities],
            "vllm_quant_method": platform.quant_method, "vllm_quant_config": platform.quant_config_class,
            "vllm_min_capability": platform.quant_min_capability,
            "check_s": timings["capability_s"]}, quant, platform.vllm_device


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
    write_json_atomic(ctx.layout.skip(ctx.name),
                      {"reason": cap["reason"], "capability": cap, "model_dir": model_dir})
    ctx.warn(f"SKIPPED: {cap['reason']} (stages.vllm_smoke.on_unsupported=skip; force=true tries anyway)")
    return True


def _inputs(ctx: StageContext, model_dir: str) -> tuple[Optional[GateSet], Optional[Checks]]:
    from launcher.mmlu.prepared import load_tokenizer

    sc, cfg = ctx.stage_cfg, ctx.cfg
    trust = bool(cfg.model.trust_remote_code)
    gate = checks = None
    try:
        if sc.score_choices:
            # the gate's tokenizer, as the gate loaded it: the token ids are the gate's own
            gate = load_gate_set(ctx.layout.mmlu_results, cfg.stages.mmlu,
                                 load_tokenizer(cfg.model.path, trust), int(sc.questions))
        if sc.prompts:
            items = generation.read_checks(str(sc.prompts))
            served = load_tokenizer(model_dir, trust)      # what vLLM serves: the export's template
            ids, texts, chat = zip(*(generation.render(c, served) for c in items))
            checks = Checks(f"jsonl:{sc.prompts}", items, list(ids), list(texts), list(chat))
    except (OSError, ValueError, GateMismatch) as e:
        raise StageFailed(f"vllm_smoke inputs: {e}") from e
    return gate, checks


def _criteria(ctx: StageContext, gate: Optional[GateSet], quant: capability.QuantInfo) -> dict:
    sc = ctx.stage_cfg
    if sc.min_agreement is not None:
        min_agree, agree_src = float(sc.min_agreement), "stages.vllm_smoke.min_agreement"
    else:
        min_agree = agreement.default_min_agreement(quant.quantized)
        agree_src = f"default for a{' quantized' if quant.quantized else 'n unquantized'} export"
    bound = gate.info.get("lower_bound") if gate is not None else None
    if sc.min_accuracy is not None:
        min_acc, acc_src = float(sc.min_accuracy), "stages.vllm_smoke.min_accuracy"
    else:
        min_acc = float(bound) if bound is not None else 0.0
        acc_src = "the gate's lower_bound" if bound is not None else "none (the gate has no lower_bound)"
    return {"min_agreement": min_agree, "min_agreement_from": agree_src, "min_accuracy": min_acc,
            "min_accuracy_from": acc_src, "tie_margin": float(sc.tie_margin), "scoring": str(sc.scoring),
            "max_tokens": int(sc.max_tokens), "nvfp4_kernels": str(sc.nvfp4_kernels),
            "kernel_args": kernels.serving_args(str(sc.nvfp4_kernels), quant.algo)}


def _backend(ctx: StageContext, model_dir: str, python: str, device: str, kernel_args: list[str]) -> Backend:
    """vLLM out of process; ``kernel_args`` (the criteria's, from ``nvfp4_kernels``) come before the
    user's ``extra_args``, so a user's own flag, later on the command line, wins."""
    sc = ctx.stage_cfg
    extra = list(kernel_args) + [str(a) for a in sc.extra_args]
    return BACKENDS[sc.mode](python=python, model_dir=model_dir,
                             log_path=ctx.layout.log(ctx.name), work_dir=ctx.stage_dir,
                             tp=int(sc.tensor_parallel_size), extra_args=extra,
                             device=device, startup_timeout_s=float(sc.startup_timeout_s),
                             request_timeout_s=float(sc.request_timeout_s), log=ctx.log)


def _write(ctx: StageContext, record: SmokeRecord, timings: Timings) -> None:
    timings.total("total_s")
    record.timings = dict(timings)   # a plain dict: asdict() would rebuild a Timings empty
    write_json_atomic(ctx.layout.vllm_responses, asdict(record))


def _report(ctx: StageContext, record: SmokeRecord) -> None:
    ch, gen = record.choices, record.generation
    if ch is not None:
        agree = "n/a" if ch["agreement"] is None else f"{ch['agreement']:.3f}"
        ctx.log(f"choices: agreement with the gate {agree} ({ch['n_agree']}/{ch['n_counted']}; "
                f"{ch['n_ties']} ties reported apart, {len(ch['tie_disagreements'])} of them differ), "
                f"min {record.criteria['min_agreement']:g}; served accuracy {ch['accuracy']:.3f} vs the "
                f"gate's {ch['gate_accuracy']:.3f} on {ch['n']} questions, min "
                f"{record.criteria['min_accuracy']:g}; choice-score difference median "
                f"{ch['median_score_diff']:.4f}, max {ch['max_score_diff']:.4f}")
        for r in [r for r in ch["questions"] if not r["agree"] and not r["tie"]][:5]:
            ctx.warn(f"{r['id']}: gate {r['gate_prediction']} (scores {r['gate_scores']}), vLLM "
                     f"{r['vllm_prediction']} (scores {r['vllm_scores']})")
    if gen is not None:
        ctx.log(f"generation: {gen['n_passed']}/{gen['n_scored']} checks passed, "
                f"{len(gen['empty_responses'])} empty of {gen['n']}")
        for r in gen["prompts"][:3]:
            ctx.log(f"  {r['id']}: {r['prompt']!r} -> {r['response']!r}")
    ctx.log(f"{'PASS' if record.passed else 'FAIL'}; timings {record.timings}")


def run(ctx: StageContext) -> None:
    if ctx.rank != 0:
        return
    timings = Timings()
    sc = ctx.stage_cfg
    os.makedirs(ctx.stage_dir, exist_ok=True)
    for stale in (ctx.layout.vllm_responses, ctx.layout.skip(ctx.name)):
        with contextlib.suppress(FileNotFoundError):
            os.remove(stale)
    model_dir = _model_dir(ctx)
    cap, quant, device = _capability(ctx, model_dir, timings)
    if _refused(ctx, cap, model_dir):
        return
    gate, checks = _inputs(ctx, model_dir)
    record = SmokeRecord(mode=sc.mode, model_dir=model_dir, capability=cap,
                         criteria=_criteria(ctx, gate, quant))
    work = Work(score_prompts=gate.token_ids if gate else (), choice_ids=gate.choice_ids if gate else (),
                scoring=str(sc.scoring), gen_prompts=checks.token_ids if checks else (),
                max_tokens=int(sc.max_tokens))
    backend = _backend(ctx, model_dir, cap["python"], device, record.criteria["kernel_args"])
    ctx.log(f"{sc.mode}: {len(work.score_prompts)} gate questions ({sc.scoring}), "
            f"{len(work.gen_prompts)} generation checks, tp={sc.tensor_parallel_size}, log {backend.log_path}")
    log_start = kernels.log_size(backend.log_path)   # this attempt's lines: the log keeps earlier ones
    try:
        with _sigterm_as_exit():
            replies = backend.run(work)
    except VllmError as e:
        record.failure, record.vllm_error, record.server = str(e), e.error_line, e.info or None
        record.failures = [record.failure]
        record.kernels = kernels.read_log(backend.log_path, log_start)
        _write(ctx, record, timings)
        _show_tail(backend.log_path)
        raise StageFailed(f"vllm_smoke: {e}") from e
    record.server, record.kernels = replies.info, kernels.read_log(backend.log_path, log_start)
    ctx.log(f"vLLM's kernels ({record.kernels['family']}): {'; '.join(record.kernels['choices']) or 'none stated'}")
    timings.update({k: replies.info.get(k) for k in ("startup_s", "score_s", "generate_s")})
    record.judge(gate, checks, replies)
    note = kernels.precision_note(record.kernels["family"])
    if note and record.choices and not record.choices["passed"]:
        record.failures = [f"{record.failures[0]} ({note})", *record.failures[1:]]
        record.failure = "; ".join(record.failures)
    _write(ctx, record, timings)
    _report(ctx, record)
    if not record.passed:
        raise StageFailed(f"vllm_smoke failed: {record.failure} "
                          f"(see {ctx.layout.vllm_responses})")
