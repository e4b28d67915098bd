"""How the local agent starts a stage's ranks: spawned, or forked from an agent that imported the stack once.

A spawned rank is a new interpreter that imports torch, Megatron-Core, ModelOpt and transformers
before its first line of work: about 10 s on an idle core, and on a machine with fewer cores than
ranks the ranks' imports share the cores (4 ranks on 2 cores: 23.8 s against 10.3 s for one import
and four forks, ``benchmarks/rank_startup.py``).  With ``executor.rank_start=auto`` (the default) the
local agent imports ``PRELOAD`` once and forks the ranks, where that is safe:

- the command is ``<this python> -m MODULE ARGS...`` for a module of ``FORKABLE`` (the fork imports
  MODULE and calls its ``main(ARGS)``, as ``python -m`` would run it);
- the ranks cannot use CUDA: torch is a CPU build, or ``CUDA_VISIBLE_DEVICES`` is empty (the executor
  sets it for ``executor.device=cpu``).  A process that initialised CUDA cannot fork a child that uses
  it, and the imports are not promised never to touch CUDA, so a rank that may use a GPU is spawned.

Everything else is spawned, as ``executor.rank_start=spawn`` always does.  What a forked rank has that
a spawned one does not is exactly ``PRELOAD``'s modules: no patch of the register is applied before
the fork (each rank applies its own), and Megatron's mamba mixer, before which the mamba_ssm stub must
be installed, is not among them (``preload`` checks both).
"""
from __future__ import annotations

import ctypes
import importlib
import logging
import os
import signal
import sys
import time
import traceback
from typing import Mapping, Optional, Sequence

PRELOAD = ("torch", "megatron.core", "modelopt.torch.quantization", "transformers")
FORKABLE = ("launcher.worker",)   # modules whose main(argv) -> exit code a forked rank may run
# modules a rank must import itself, after its own set-up (the mamba_ssm stub, the patch register)
NOT_PRELOADED = ("mamba_ssm", "selective_scan_cuda", "megatron.core.ssm.mamba_mixer", "launcher.megatron.patches")
SPAWN, FORK = "spawn", "fork"
# environment variables read when the interpreter starts (PYTHON*, LD_*), when a runtime loads (OMP_*,
# MKL_*, KMP_*, CUDA_*: CUDA_VISIBLE_DEVICES) or when torch, huggingface_hub or transformers is imported
# (TORCH*, PYTORCH_*, HF_*, TRANSFORMERS_*): a process forked from a preloaded one (a pooled test rank,
# an agent of a shared local zygote) keeps the values that process started with
IMPORT_TIME_PREFIXES = ("PYTHON", "LD_", "OMP_", "MKL_", "KMP_", "CUDA_", "TORCH", "PYTORCH_", "HF_",
                        "TRANSFORMERS_")
_PR_SET_NAME = 15


def forkable(cmd: Sequence[str], executable: str = sys.executable) -> Optional[list[str]]:
    """``[MODULE, *ARGS]`` if ``cmd`` is ``<executable> -m MODULE ARGS...`` with MODULE in ``FORKABLE``, else None."""
    if len(cmd) < 3 or cmd[1] != "-m" or cmd[2] not in FORKABLE:
        return None
    if os.path.realpath(cmd[0]) != os.path.realpath(executable):
        return None
    return list(cmd[2:])


def choose(requested: str, cmd: Sequence[str], environ: Mapping[str, str], cuda_build: Optional[str],
           executable: str = sys.executable) -> tuple[str, str]:
    """(``fork`` or ``spawn``, why) for a stage's ranks; ``cuda_build`` is ``torch.version.cuda``."""
    if requested == SPAWN:
        return SPAWN, "executor.rank_start=spawn"
    assert requested == "auto", requested   # the schema allows auto | spawn
    if forkable(cmd, executable) is None:
        return SPAWN, f"the command is not `{executable} -m` one of {', '.join(FORKABLE)}"
    if environ.get("CUDA_VISIBLE_DEVICES") == "":
        return FORK, "CUDA is hidden from the ranks"
    if cuda_build is None:
        return FORK, "torch is a CPU build"
    return SPAWN, "the ranks may use a GPU (CUDA must not be initialised before a fork)"


def import_time_differences(a: Mapping[str, str], b: Mapping[str, str]) -> list[str]:
    """The variables read at start or import (``IMPORT_TIME_PREFIXES``) whose values differ between two
    environments (one set, the other not, counts): what a preloaded process cannot give a forked child."""
    keys = {k for k in (*a, *b) if k.startswith(IMPORT_TIME_PREFIXES)}
    return sorted(k for k in keys if a.get(k) != b.get(k))


NVIDIA_CONTROL_DEVICE = "/dev/nvidiactl"


def gpu_may_be_visible(environ: Mapping[str, str], control_device: Optional[str] = None) -> bool:
    """Torch-free: this host has an NVIDIA driver (its control device) and CUDA is not hidden from the
    ranks.  The local executor then spawns agents without first starting a preloaded process that
    would import torch only to find the ranks must be spawned."""
    return environ.get("CUDA_VISIBLE_DEVICES") != "" and os.path.exists(control_device or NVIDIA_CONTROL_DEVICE)


def preload(modules: Sequence[str] = PRELOAD) -> float:
    """Import ``modules`` in this process (the agent, before it forks); returns the seconds taken."""
    t = time.perf_counter()
    for name in modules:
        importlib.import_module(name)
    early = [m for m in NOT_PRELOADED if m in sys.modules]
    assert not early, f"preloading {', '.join(modules)} imported {early}, which a rank must import itself"
    return time.perf_counter() - t


class _NoTraceback(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.exc_info, record.exc_text = None, None
        return True


def quiet_failed_rank_tracebacks() -> None:
    """torch's elastic agent logs a failed forked rank with the traceback of its own ``join`` (which
    says nothing about the rank); keep its one line ("failed (exitcode: 3) local_rank: 0 ..."), as
    for a spawned rank, and drop the traceback: the rank printed its own error."""
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_NoTraceback())


def name_process(name: str) -> None:
    """Set this process's name (``ps -o comm``, ``top``, psutil's ``name()``; at most 15 bytes), e.g.
    ``quantize:r1``: a forked rank's command line is its agent's, so the name is how to tell ranks apart."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)
    except (OSError, AttributeError):   # no prctl (not Linux): the name is cosmetic
        pass


def exit_status(e: SystemExit) -> int:
    """The status an interpreter ends with for an uncaught ``e``: its int code, 0 for None, else 1."""
    return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)


def run_forked_rank(module: str, *args: str) -> None:
    """A forked rank's body: the agent's signal handlers undone, then ``module.main(args)``.
    Success returns (the agent collects return values); a failure exits with main's code, an
    exception main lets out with its traceback printed and code 1."""
    assert module in FORKABLE, module
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.argv = [module, *args]
    try:
        code = importlib.import_module(module).main(list(args))
    except SystemExit as e:
        code = exit_status(e)
    except BaseException:  # noqa: BLE001 - printed as a spawned rank's interpreter would print it
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    if code:
        end_children()
        os._exit(int(code))


def end_children(grace_s: float = 5.0) -> None:
    """Terminate the multiprocessing children a failing forked rank leaves behind (e.g. dist_checkpointing's
    writers), as multiprocessing's own exit handler would; ``os._exit`` skips it, and a child left running
    would keep the stage's output pipe open."""
    import multiprocessing

    children = multiprocessing.active_children()
    for child in children:
        child.terminate()
    for child in children:
        child.join(grace_s)
        if child.is_alive():
            child.kill()
            child.join(grace_s)
