"""The two ways the smoke stage talks to vLLM, behind one protocol.

``Backend.run(work) -> Replies``: vLLM comes up (once), scores the choice prompts and greedily
completes the generation prompts, and is stopped before the call returns (also on failure,
which raises ``VllmError``).  Everything is token ids, so both backends see the same input.
``Replies.info`` is what responses.json records about the process: mode, command, pid,
startup_s, score_s, generate_s.

    ServerBackend   the OpenAI server on 127.0.0.1:<free port> (``mode: server``)
    OfflineBackend  the offline engine in a subprocess (``mode: offline``)
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Protocol, Sequence

from launcher.vllm.server import VllmError, VllmServer, run_offline


@dataclass(frozen=True)
class Work:
    score_prompts: Sequence[Sequence[int]] = ()   # the gate's prompts (token ids)
    choice_ids: Sequence[int] = ()                 # " A" .. " D"
    scoring: str = "prompt_logprobs"               # launcher.vllm.client.SCORING_METHODS
    gen_prompts: Sequence[Sequence[int]] = ()      # generation checks (token ids)
    max_tokens: int = 32


@dataclass
class Replies:
    choice_logprobs: list[list[float]]   # per score prompt: log p(choice | prompt), vocab-normalised
    texts: list[str]                     # per generation prompt
    info: dict


class Backend(Protocol):
    mode: str
    log_path: str

    def run(self, work: Work) -> Replies:
        ...


@dataclass
class _Common:
    python: str
    model_dir: str
    log_path: str
    work_dir: str                       # the stage directory (offline request/response files)
    tp: int = 1
    extra_args: Sequence[str] = field(default_factory=tuple)
    device: str = "cpu"
    startup_timeout_s: float = 600.0
    request_timeout_s: float = 600.0
    log: Optional[Callable[[str], None]] = None


@dataclass
class ServerBackend(_Common):
    mode: str = "server"

    def run(self, work: Work) -> Replies:
        server = VllmServer(self.python, self.model_dir, self.log_path, tp=self.tp,
                            extra_args=list(self.extra_args), device=self.device,
                            startup_timeout_s=self.startup_timeout_s)
        timings: dict = {}
        try:
            server.start()
            if self.log:
                self.log(f"server healthy at {server.base_url} after {server.startup_s:.1f} s")
            scores, texts = [], []
            if work.score_prompts:
                t = time.monotonic()
                scores = server.choice_logprobs(work.score_prompts, work.choice_ids, work.scoring,
                                                self.request_timeout_s, self._progress)
                timings["score_s"] = round(time.monotonic() - t, 2)
            if work.gen_prompts:
                t = time.monotonic()
                texts = server.complete(work.gen_prompts, work.max_tokens, self.request_timeout_s)
                timings["generate_s"] = round(time.monotonic() - t, 2)
        except VllmError as e:
            e.info = e.info or server.info()
            raise
        finally:
            server.stop()
        return Replies(scores, texts, {**server.info(), **timings})

    def _progress(self, done: int, total: int) -> None:
        if self.log:
            self.log(f"scored {done}/{total} questions")


@dataclass
class OfflineBackend(_Common):
    mode: str = "offline"

    def run(self, work: Work) -> Replies:
        request = {
            "score": {"method": work.scoring, "prompts": [list(p) for p in work.score_prompts],
                      "choice_ids": list(work.choice_ids)} if work.score_prompts else None,
            "generate": {"prompts": [list(p) for p in work.gen_prompts],
                         "max_tokens": int(work.max_tokens)} if work.gen_prompts else None}
        result, info = run_offline(self.python, self.model_dir, request, self.log_path,
                                   self.work_dir, tp=self.tp, extra_args=list(self.extra_args),
                                   device=self.device,
                                   timeout_s=self.startup_timeout_s + self.request_timeout_s)
        scores = result.get("choice_logprobs") or []
        texts = result.get("texts") or []
        if len(scores) != len(work.score_prompts) or len(texts) != len(work.gen_prompts):
            raise VllmError(f"vLLM offline engine returned {len(scores)} score rows for "
                            f"{len(work.score_prompts)} prompts and {len(texts)} texts for "
                            f"{len(work.gen_prompts)}", self.log_path, info=info)
        return Replies(scores, texts, info)


BACKENDS = {"server": ServerBackend, "offline": OfflineBackend}
