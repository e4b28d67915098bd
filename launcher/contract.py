"""The words both processes share: the launcher (cli, pipeline, executors, rundir) and the ranks
(worker, stages, the libraries under them).  Bottom of the import graph: no torch, no launcher
imports.

  * ``StageName``   the stages, in pipeline order (``STAGE_ORDER``);
  * ``StageStatus`` a stage's status in metadata.json;
  * ``JobState``    a finished job's state, as Slurm names it (the local executor reports the same);
  * ``ExitCode``    what a rank, a stage and ``launch`` exit with;
  * ``StageFailed`` what a stage raises to fail with an exit code;
  * ``UserError``   a mistake in the user's input (config, data file, recipe, path): one line per
    problem on the console, never a traceback (``problems``, ``report_user_error``);
  * ``write_json_atomic`` / ``write_text_atomic`` / ``atomic_dir``: outputs appear whole or not at all;
  * the secret rule (``is_secret``, ``split_secrets``, ``MASK``): which environment variables are
    never written to a file;
  * ``RunLayout``: every path of the run directory that more than one module reads or writes.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from enum import IntEnum, StrEnum
from typing import Any, Iterator, Mapping


class StageName(StrEnum):
    QUANTIZE = "quantize"
    MMLU = "mmlu"
    EXPORT = "export"
    VLLM_SMOKE = "vllm_smoke"


STAGE_ORDER = tuple(s.value for s in StageName)


# The value sets of the config's choice keys (launcher.schema types its fields with them):
# each member's name is its value, as OmegaConf writes and reads an Enum field by name.
class Choice(StrEnum):
    """A config value out of a fixed set: compares, formats and repr()s as its plain string."""

    def __repr__(self) -> str:
        return repr(self.value)


class ShardMode(Choice):
    auto = "auto"
    balanced = "balanced"
    lockstep = "lockstep"
    dense_dp = "dense_dp"


class Dispatcher(Choice):
    alltoall = "alltoall"
    allgather = "allgather"


class BaselineMode(Choice):
    none = "none"
    recorded = "recorded"
    evaluate = "evaluate"
    cached = "cached"


class Device(Choice):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


class RankStart(Choice):
    auto = "auto"      # forked from an agent that imported the stack once where ranks cannot use CUDA, else spawned
    spawn = "spawn"    # every rank a new interpreter (launcher.executors.rank_start)


class VllmMode(Choice):
    server = "server"
    offline = "offline"


class VllmScoring(Choice):
    prompt_logprobs = "prompt_logprobs"
    choice_logprobs = "choice_logprobs"


class Nvfp4Kernels(Choice):
    """Which vLLM kernels serve an NVFP4 export in the smoke."""

    auto = "auto"            # vLLM's own choice (below Blackwell: Marlin, weight-only)
    emulation = "emulation"  # vLLM's NVFP4 emulation: activations quantized too, as the gate does


class OnUnsupported(Choice):
    skip = "skip"
    fail = "fail"


class Dtype(Choice):
    """Parameter dtypes a stage builds its model in on CUDA (CPU always runs float32)."""

    bfloat16 = "bfloat16"
    float16 = "float16"
    float32 = "float32"


def values(choices: type[StrEnum]) -> tuple[str, ...]:
    return tuple(m.value for m in choices)


class StageStatus(StrEnum):
    """A stage's ``status`` in metadata.json."""

    PENDING = "pending"
    SUBMITTED = "submitted"      # a Slurm job exists for it
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    SKIPPED = "skipped"          # by resume, or by the stage itself (<stage>/skip.json)
    DISABLED = "disabled"
    CANCELLED = "cancelled"
    NOT_RUN = "not_run"          # an earlier stage failed or was cancelled


class JobState(StrEnum):
    """Final job states as Slurm names them; the local executor reports the same words."""

    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"
    TIMEOUT = "TIMEOUT"
    RUNNING = "RUNNING"
    UNKNOWN = "UNKNOWN"          # the controller no longer knows the job


class ExitCode(IntEnum):
    OK = 0
    FAILED = 1                   # a stage failed
    USAGE = 2                    # invalid config or usage (launch)
    GATE_FAILED = 3              # the MMLU gate decided "fail" (every rank exits with it)
    DESYNC = 4                   # the desync guard tripped
    PREFLIGHT = 5                # group check failed before the stage started
    CANCELLED = 130              # Ctrl-C / SIGTERM


EXIT_REASONS = {ExitCode.GATE_FAILED: "gate failed (accuracy below the bound)",
                ExitCode.DESYNC: "desync guard tripped",
                ExitCode.PREFLIGHT: "preflight failed (process groups)",
                ExitCode.CANCELLED: "cancelled"}


class StageFailed(RuntimeError):
    """A stage decided the run must fail; ``exit_code`` is what every rank exits with."""

    def __init__(self, message: str, exit_code: int = ExitCode.FAILED):
        super().__init__(message)
        self.exit_code = exit_code


class UserError(ValueError):
    """A mistake in the user's input - a config value, a data file, a recipe, a path - found by
    validation, a verb or a stage.  Its message names the input (key, file and line or record),
    what was found and what is valid, one problem per line.  ``launch`` prints those lines and no
    traceback (exit 2 before anything starts); a stage prints them and sends the traceback to its
    log only.  Any other exception is a bug and keeps its traceback on the console."""

    @property
    def problems(self) -> list[str]:
        return [line.strip() for line in str(self).splitlines() if line.strip()]


def report_user_error(prefix: str, error: UserError, log_path: str, traceback_text: str, console) -> None:
    """A stage rank's report of a ``UserError``: one console line per problem, the traceback
    appended to the stage's log only (the console is the launcher's tee of the rank's output)."""
    for line in error.problems:
        print(f"{prefix} STAGE FAILED: {line}", file=console, flush=True)
    try:
        with open(log_path, "a") as f:
            f.write(f"{prefix} traceback of the error above (log only):\n{traceback_text}")
    except OSError:
        pass   # the stage's directory is gone: the console lines are the report


# -- atomic writers -------------------------------------------------------------------------------
def write_text_atomic(path: str, text: str) -> None:
    """``path`` holds the old text or the new one, never a part; a failed write (a full disk) leaves
    no temporary file behind."""
    tmp = f"{path}.tmp-{os.getpid()}"
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    try:
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def write_json_atomic(path: str, data: Any) -> None:
    write_text_atomic(path, json.dumps(data, indent=2, sort_keys=False, default=str) + "\n")


@contextlib.contextmanager
def atomic_dir(final: str, overwrite: bool = False) -> Iterator[str]:
    """Yield a temporary directory next to ``final``; rename it into place on success.

    Single-process helper (call it on one rank, or give every rank the same decision).  An
    interrupted write leaves only ``<final>.tmp-*``, never a partial ``final``.
    """
    if os.path.exists(final) and not overwrite:
        raise StageFailed(f"{final} exists; refusing to overwrite (set overwrite=true to replace it)")
    tmp = f"{final}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if os.path.exists(final):
        shutil.rmtree(final)
    os.replace(tmp, final)


# -- the secret rule ------------------------------------------------------------------------------
SECRET_NAME = re.compile(r"(TOKEN|SECRET|PASSWORD|PASSWD|API_KEY|ACCESS_KEY|PRIVATE_KEY|CREDENTIAL)", re.IGNORECASE)
MASK = "***"


def is_secret(name: str) -> bool:
    """A variable whose value never goes into a file (config.yaml masks it, sbatch scripts omit it)."""
    return bool(SECRET_NAME.search(name))


def split_secrets(env: Mapping[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """(plain, secret) by variable name."""
    plain = {k: v for k, v in env.items() if not is_secret(k)}
    secret = {k: v for k, v in env.items() if is_secret(k)}
    return plain, secret


# -- the run directory ----------------------------------------------------------------------------
class RunLayout:
    """Every shared path of one run directory::

        config.yaml  metadata.json
        <stage>/log.txt  <stage>/manifest.json  <stage>/skip.json
        <stage>/profile-rank<R>.pstats|.txt  (PTQ_PROFILE; not outputs)
        quantize/checkpoint  quantize/summary.json
        mmlu/results.json
        export/<name>  export/verify.json
        vllm_smoke/responses.json
        slurm/jobs.json  (and the sbatch scripts beside it)
    """

    PROFILE_PREFIX = "profile-rank"

    def __init__(self, path: str):
        self.path = path

    def stage_dir(self, stage: str) -> str:
        return os.path.join(self.path, stage)

    @property
    def config_yaml(self) -> str:
        return os.path.join(self.path, "config.yaml")

    @property
    def metadata_json(self) -> str:
        return os.path.join(self.path, "metadata.json")

    def log(self, stage: str) -> str:
        return os.path.join(self.path, stage, "log.txt")

    def manifest(self, stage: str) -> str:
        return os.path.join(self.path, stage, "manifest.json")

    def profile_base(self, stage: str, rank: int) -> str:
        """``rank``'s profile of ``stage`` (launcher.profiling), without its suffix (.pstats, .txt)."""
        return os.path.join(self.path, stage, f"{self.PROFILE_PREFIX}{rank}")

    def skip(self, stage: str) -> str:
        """Written by a stage that decided not to do its work (the pipeline records it SKIPPED)."""
        return os.path.join(self.path, stage, "skip.json")

    @property
    def quantize_checkpoint(self) -> str:
        return os.path.join(self.path, StageName.QUANTIZE, "checkpoint")

    @property
    def quantize_summary(self) -> str:
        return os.path.join(self.path, StageName.QUANTIZE, "summary.json")

    @property
    def mmlu_results(self) -> str:
        return os.path.join(self.path, StageName.MMLU, "results.json")

    def export_dir(self, name: str) -> str:
        return os.path.join(self.path, StageName.EXPORT, name)

    @property
    def export_verify(self) -> str:
        return os.path.join(self.path, StageName.EXPORT, "verify.json")

    @property
    def vllm_responses(self) -> str:
        return os.path.join(self.path, StageName.VLLM_SMOKE, "responses.json")

    @property
    def slurm_dir(self) -> str:
        return os.path.join(self.path, "slurm")

    @property
    def slurm_jobs(self) -> str:
        return os.path.join(self.path, "slurm", "jobs.json")
