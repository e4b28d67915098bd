"""The two ways the smoke stage talks to vLLM, behind one protocol.

``Backend.generate(prompts, max_tokens) -> (texts, info)``: vLLM comes up, answers, and is
stopped before the call returns (also on failure, which raises ``VllmError``).  ``info`` is
what responses.json records about the process: mode, command, pid, startup_s, generate_s.

    ServerBackend   the OpenAI server on 127.0.0.1:<free port> (``mode: server``)
    OfflineBackend  the offline engine in a subprocess (``mode: offline``)
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol, Sequence

from launcher.vllm.server import VllmError, VllmServer, run_offline


class Backend(Protocol):
    mode: str
    log_path: str

    def generate(self, prompts: Sequence[str], max_tokens: int) -> tuple[list[str], dict]:
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


@dataclass
class ServerBackend(_Common):
    mode: str = "server"

    def generate(self, prompts: Sequence[str], max_tokens: int) -> tuple[list[str], dict]:
        server = VllmServer(self.python, self.model_dir, self.log_path, tp=self.tp,
                            extra_args=list(self.extra_args), device=self.device,
                            startup_timeout_s=self.startup_timeout_s)
        try:
            server.start()
            t1 = time.monotonic()
            texts = server.complete(prompts, max_tokens, self.request_timeout_s)
            generate_s = round(time.monotonic() - t1, 2)
        except VllmError as e:
            e.info = e.info or server.info()
            raise
        finally:
            server.stop()
        return texts, {**server.info(), "generate_s": generate_s}


@dataclass
class OfflineBackend(_Common):
    mode: str = "offline"

    def generate(self, prompts: Sequence[str], max_tokens: int) -> tuple[list[str], dict]:
        return run_offline(self.python, self.model_dir, prompts, max_tokens, self.log_path,
                           self.work_dir, tp=self.tp, extra_args=list(self.extra_args),
                           device=self.device,
                           timeout_s=self.startup_timeout_s + self.request_timeout_s)


BACKENDS = {"server": ServerBackend, "offline": OfflineBackend}
