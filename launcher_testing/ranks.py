"""Run a function on N gloo ranks as real subprocesses, with a timeout.

    results = run_on_ranks("test_megatron_model:logits_worker", nprocs=4,
                           kwargs={"hf_path": str(path)}, timeout_s=240)

Each rank is ``python -m launcher_testing.ranks MODULE:FUNCTION KWARGS_JSON RESULT_DIR`` with
RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT set (as torchrun would) and
OMP_NUM_THREADS=1.  The function is called as ``function(**kwargs)``; what it returns (JSON-able)
is collected per rank.  Any rank failing, or the run exceeding ``timeout_s``, raises
``RanksFailed`` carrying every rank's output tail; on timeout the ranks are killed.  The entry
point puts the repository root and ``tests/`` first on ``sys.path`` (so a target in a test module
imports), and has the ``__main__`` guard that dist_checkpointing's writer needs.
"""
from __future__ import annotations

import importlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class RanksFailed(AssertionError):
    def __init__(self, message: str, returncodes: list, outputs: list[str], timed_out: bool):
        super().__init__(message)
        self.returncodes = returncodes
        self.outputs = outputs
        self.timed_out = timed_out


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_on_ranks(target: str, nprocs: int, kwargs: dict | None = None, timeout_s: float = 300,
                 env: dict[str, str] | None = None, tail_chars: int = 6000) -> list:
    """Run ``target`` ("package.module:function") on ``nprocs`` ranks; return each rank's result."""
    if os.environ.get("PTQ_TORCH_FREE") == "1":
        raise AssertionError(f"{target}: starts torch ranks in a torch-free run (make test-fast); mark the test `torch`")
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="ranks-") as workdir:
        procs, logs = [], []
        for rank in range(nprocs):
            rank_env = {
                **os.environ,
                "RANK": str(rank), "WORLD_SIZE": str(nprocs), "LOCAL_RANK": str(rank),
                "LOCAL_WORLD_SIZE": str(nprocs), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
                "PYTHONPATH": os.pathsep.join([REPO_ROOT, os.path.join(REPO_ROOT, "tests"), os.environ.get("PYTHONPATH", "")]),
                "PYTHONWARNINGS": "ignore",
                **(env or {}),
            }
            log = open(os.path.join(workdir, f"rank{rank}.log"), "w+")
            logs.append(log)
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "launcher_testing.ranks", target, json.dumps(kwargs or {}), workdir],
                env=rank_env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT, start_new_session=True))
        deadline = time.time() + timeout_s
        timed_out = False
        while any(p.poll() is None for p in procs):
            if time.time() > deadline:
                timed_out = True
                break
            if any(p.returncode not in (None, 0) for p in procs):
                # one rank died: give the others a moment to fail on their own, then stop them
                grace = time.time() + 20
                while time.time() < grace and any(p.poll() is None for p in procs):
                    time.sleep(0.2)
                break
            time.sleep(0.2)
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)   # our own child's process group
                p.wait()
        outputs = []
        for log in logs:
            log.seek(0)
            outputs.append(log.read()[-tail_chars:])
            log.close()
        codes = [p.returncode for p in procs]
        if timed_out or any(c != 0 for c in codes):
            detail = "\n".join(f"----- rank {r} (exit {c}) -----\n{out}" for r, (c, out) in enumerate(zip(codes, outputs)))
            why = f"timed out after {timeout_s} s" if timed_out else f"exit codes {codes}"
            raise RanksFailed(f"{target} on {nprocs} ranks: {why}\n{detail}", codes, outputs, timed_out)
        results = []
        for rank in range(nprocs):
            with open(os.path.join(workdir, f"result{rank}.json")) as f:
                results.append(json.load(f))
        return results


def _main(target: str, kwargs_json: str, workdir: str) -> None:
    module_name, _, func_name = target.partition(":")
    sys.path[:0] = [REPO_ROOT, os.path.join(REPO_ROOT, "tests")]
    func = getattr(importlib.import_module(module_name), func_name)
    result = func(**json.loads(kwargs_json))
    rank = int(os.environ["RANK"])
    with open(os.path.join(workdir, f"result{rank}.json.tmp"), "w") as f:
        json.dump(result, f)
    os.replace(os.path.join(workdir, f"result{rank}.json.tmp"), os.path.join(workdir, f"result{rank}.json"))


if __name__ == "__main__":
    _main(*sys.argv[1:4])
