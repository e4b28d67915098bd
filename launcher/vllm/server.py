"""Run vLLM out of process: the OpenAI-compatible server, or the offline engine in a subprocess.

Both log to one file (vllm_smoke/log.txt), run in their own process group, and are stopped
with every child (``launcher.vllm.procs``).  Failures raise ``VllmError`` carrying the log's
tail and its most telling error line (vLLM's own refusal, e.g. "Failed to find a kernel that
can implement the NVFP4 linear layer").
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

from launcher.ports import free_port
from launcher.vllm import client
from launcher.vllm.probe import vllm_env
from launcher.vllm.procs import GroupProcess, error_line, log_tail

OFFLINE_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "offline_engine.py")


class VllmError(RuntimeError):
    def __init__(self, message: str, log_path: str = "", tail: Sequence[str] = (),
                 error: Optional[str] = None, info: Optional[dict] = None):
        self.tail = list(tail)
        self.info = info or {}
        # the engine's error can sit far above the tail (vLLM prints its traceback twice, then the
        # API server's own): search the log's last 400 lines for it
        self.error_line = error or error_line(log_tail(log_path, 400) if log_path else self.tail)
        detail = f" - vLLM said: {self.error_line}" if self.error_line else ""
        super().__init__(f"{message}{detail}" + (f" (log: {log_path})" if log_path else ""))
        self.log_path = log_path
        self.reason = message


@dataclass
class VllmServer:
    """``with VllmServer(...) as srv: srv.complete(token_ids, max_tokens)``; always stopped on exit."""

    python: str
    model_dir: str
    log_path: str
    tp: int = 1
    extra_args: Sequence[str] = ()
    device: str = "cpu"
    host: str = "127.0.0.1"
    port: Optional[int] = None
    startup_timeout_s: float = 600.0
    env: Optional[dict] = None
    proc: Optional[GroupProcess] = field(default=None, init=False)
    startup_s: Optional[float] = field(default=None, init=False)
    model_name: Optional[str] = field(default=None, init=False)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        return [self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model_dir,
                "--enforce-eager", "--host", self.host, "--port", str(self.port),
                "--tensor-parallel-size", str(self.tp), *self.extra_args]

    def start(self) -> "VllmServer":
        """Start the server and wait for /health; raises VllmError (server stopped) on failure."""
        if self.port is None:
            self.port = free_port()   # below the ephemeral range: launcher/ports.py
        t0 = time.monotonic()
        self.proc = GroupProcess(self.command(), self.log_path, env=vllm_env(self.env, self.device))
        try:
            self._wait_healthy(t0)
            self.startup_s = round(time.monotonic() - t0, 2)
            names = client.models(self.base_url)
            self.model_name = names[0] if names else self.model_dir
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_healthy(self, t0: float) -> None:
        assert self.proc is not None
        while True:
            rc = self.proc.poll()
            if rc is not None:
                raise VllmError(f"vLLM server exited with code {rc} before it became healthy",
                                self.log_path, log_tail(self.log_path))
            if client.healthy(self.base_url):
                return
            waited = time.monotonic() - t0
            if waited > self.startup_timeout_s:
                raise VllmError(f"vLLM server not healthy after {waited:.0f} s "
                                f"(stages.vllm_smoke.startup_timeout_s={self.startup_timeout_s:g})",
                                self.log_path, log_tail(self.log_path))
            time.sleep(1.0)

    def _ask(self, what: str, fn, *args):
        assert self.model_name is not None, "start() first"
        try:
            return fn(self.base_url, self.model_name, *args)
        except client.ClientError as e:
            raise VllmError(f"{what} request failed: {e}", self.log_path, log_tail(self.log_path),
                            info=self.info()) from e

    def complete(self, prompts: Sequence[Sequence[int]], max_tokens: int,
                 timeout: float = 600.0) -> list[str]:
        """Greedy completions of token-id prompts."""
        return self._ask("completion", client.complete, prompts, max_tokens, timeout)

    def choice_logprobs(self, prompts: Sequence[Sequence[int]], choice_ids: Sequence[int],
                        method: str, timeout: float = 600.0, progress=None) -> list[list[float]]:
        """Per prompt, log p(choice | prompt) of each choice id (``client.choice_logprobs``)."""
        return self._ask("choice scoring", client.choice_logprobs, prompts, choice_ids, method,
                         timeout, progress)

    def info(self) -> dict:
        return {"mode": "server", "python": self.python, "url": self.base_url, "tp": self.tp,
                "model": self.model_name, "pid": self.proc.pid if self.proc else None,
                "command": self.command(), "startup_s": self.startup_s}

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()

    def __enter__(self) -> "VllmServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def run_offline(python: str, model_dir: str, work: dict, log_path: str, work_dir: str,
                tp: int = 1, extra_args: Sequence[str] = (), device: str = "cpu",
                timeout_s: float = 900.0, env: Optional[dict] = None) -> tuple[dict, dict]:
    """Run ``offline_engine.py`` on ``work`` (its IN.json) in a subprocess; (OUT.json, info)."""
    os.makedirs(work_dir, exist_ok=True)
    in_path = os.path.join(work_dir, "offline_work.json")
    out_path = os.path.join(work_dir, "offline_out.json")
    with open(in_path, "w") as f:
        json.dump(work, f)
    if os.path.exists(out_path):
        os.remove(out_path)
    cmd = [python, OFFLINE_SCRIPT, "--model", model_dir, "--work", in_path, "--out", out_path,
           "--tp", str(tp), *extra_args]
    t0 = time.monotonic()
    proc = GroupProcess(cmd, log_path, env=vllm_env(env, device))
    try:
        rc = proc.wait(timeout_s)
    finally:
        proc.stop()
    info = {"mode": "offline", "python": python, "tp": tp, "command": cmd, "pid": proc.pid,
            "wall_s": round(time.monotonic() - t0, 2)}
    try:
        with open(out_path) as f:
            result = json.load(f)
    except (OSError, json.JSONDecodeError):
        result = {}
    for p in (in_path, out_path):
        if os.path.exists(p):
            os.remove(p)
    if rc is None:
        raise VllmError(f"vLLM offline engine did not finish within {timeout_s:g} s",
                        log_path, log_tail(log_path), info=info)
    if "error" in result or rc != 0:
        first = (result.get("error") or "").splitlines()[:1]
        raise VllmError(f"vLLM offline engine failed (exit {rc})", log_path, log_tail(log_path),
                        error=first[0][:500] if first else None, info=info)
    info.update({k: result.get(k) for k in ("load_s", "score_s", "generate_s", "vllm_version")})
    info["startup_s"] = result.get("load_s")
    return result, info
