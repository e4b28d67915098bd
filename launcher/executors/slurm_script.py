"""sbatch scripts for pipeline stages - pure functions of (StagePlan, SlurmExecutorConfig, run dir).

Nothing here touches the file system, the clock or the environment, so every script is
reproducible and golden-tested (tests/test_slurm_script.py, tests/golden/*.sbatch).  The job
dependency (which names job ids) is not part of the script: the executor passes it to
``sbatch --dependency`` (``dependency_spec``), so a script can be resubmitted as it is.

One script per stage::

    #SBATCH lines     job name, nodes (executor.nodes; fewer for a stage with fewer ranks), tasks
                      per node (= world / nodes), GPUs per node, time, partition, account, qos,
                      cpus per task, memory, --no-requeue (a failed node fails the stage instead of
                      rerunning it unseen later), output+error -> the stage's log.txt (appended, so
                      a resumed stage keeps the first attempt's log)
    exports           executor env, then the stage's env; OMP_NUM_THREADS, PYTHONUNBUFFERED (live
                      logs); values that look like secrets are NOT written - the executor hands
                      them to sbatch's environment, which Slurm forwards to the job (--export=ALL)
    setup lines       verbatim (module load ..., source ...)
    rendezvous        MASTER_ADDR = first host of the allocation (``hostname`` inside a job is
                      not the node name), MASTER_PORT = executor.master_port, or derived from the
                      job id when master_port is 0 (jobs sharing a node never collide); the worker
                      derives the same two from srun's variables when they are missing
                      (slurm_env.rendezvous_defaults)
    srun              --ntasks=world, --kill-on-bad-exit (one dead rank ends the stage instead of
                      hanging its peers), pyxis --container-image/--container-mounts when set,
                      then the stage's argv; each rank reads SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID/
                      SLURM_NODEID (launcher/megatron/dist.rank_env)
"""
from __future__ import annotations

import os
import re
import shlex
from typing import TYPE_CHECKING, Optional, Sequence

from launcher.executors.base import StagePlan
from launcher.slurm_env import DERIVED_PORT_BASE, DERIVED_PORT_SPAN
from launcher.contract import split_secrets  # one rule for what is a secret: config.yaml masks the same names

if TYPE_CHECKING:   # a DictConfig merged onto it (compose, the worker) or the dataclass
    from launcher.schema import SlurmExecutorConfig

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_TIME = re.compile(r"^((\d+-)?\d+(:\d{1,2}){0,2}|UNLIMITED|INFINITE)$", re.IGNORECASE)
TIME_SYNTAX = "minutes, MM:SS, HH:MM:SS or D-HH[:MM[:SS]]"


def valid_time(value: str) -> bool:
    """Slurm's --time syntax (empty: no limit line)."""
    return not value or bool(_TIME.match(value))


class ScriptError(ValueError):
    """A config value that cannot make a valid sbatch script; the message names the key."""


def stage_env(plan: StagePlan, cfg: SlurmExecutorConfig) -> dict[str, str]:
    """Environment of every rank of the stage: executor.env, then the plan's env (wins)."""
    env: dict[str, str] = {}
    for source in (cfg.env, plan.env):
        for k, v in dict(source).items():
            if not _ENV_NAME.match(str(k)):
                raise ScriptError(f"env: {k!r} is not a valid environment variable name")
            env[str(k)] = "" if v is None else str(v)
    return env


def default_job_name(plan: StagePlan, run_dir: str) -> str:
    """``<job_name>.<run_id>.<stage>`` from ``<runs_root>/<job_name>/<run_id>``."""
    run_dir = os.path.normpath(run_dir)
    run_id = os.path.basename(run_dir)
    job = os.path.basename(os.path.dirname(run_dir))
    parts = [p for p in (job, run_id, plan.name) if p]
    return ".".join(parts)


def stage_nodes(world_size: int, nodes: int) -> int:
    """Nodes a stage runs on: executor.nodes, or one per rank when the stage has fewer ranks than
    that (vllm_smoke's single server rank runs on one node of a two-node pipeline)."""
    return max(1, min(nodes, world_size))


def tasks_per_node(plan: StagePlan, cfg: SlurmExecutorConfig) -> int:
    nodes = int(cfg.nodes)
    if nodes < 1:
        raise ScriptError(f"executor.nodes must be >= 1, got {nodes}")
    if plan.world_size < 1:
        raise ScriptError(f"stage {plan.name}: world_size must be >= 1, got {plan.world_size}")
    nodes = stage_nodes(plan.world_size, nodes)
    if plan.world_size % nodes:
        raise ScriptError(
            f"stage {plan.name}: world size {plan.world_size} does not split evenly over "
            f"executor.nodes={nodes}; valid node counts: "
            f"{[n for n in range(1, plan.world_size + 1) if plan.world_size % n == 0]}")
    ntpn = plan.world_size // nodes
    gpus = int(cfg.gpus_per_node)
    if gpus and ntpn > gpus:
        raise ScriptError(
            f"stage {plan.name}: {ntpn} ranks per node (world {plan.world_size} / executor.nodes={nodes}) "
            f"but executor.gpus_per_node={gpus}: one rank per GPU needs executor.nodes >= "
            f"{-(-plan.world_size // gpus)}")
    return ntpn


def render_sbatch(plan: StagePlan, cfg: SlurmExecutorConfig, run_dir: str, job_name: Optional[str] = None) -> str:
    """The sbatch script of one stage (text, ends with a newline)."""
    ntpn = tasks_per_node(plan, cfg)
    nodes = plan.world_size // ntpn
    time_limit = str(cfg.time or "")
    if not valid_time(time_limit):
        raise ScriptError(f"executor.time={time_limit!r}: use {TIME_SYNTAX}")
    if not plan.argv:
        raise ScriptError(f"stage {plan.name}: empty argv")
    if not plan.log_path:
        raise ScriptError(f"stage {plan.name}: no log_path")
    q = shlex.quote
    name = job_name or default_job_name(plan, run_dir)
    sb = [
        f"--job-name={name}",
        f"--nodes={nodes}",
        f"--ntasks-per-node={ntpn}",
    ]
    gpus = int(cfg.gpus_per_node)
    if gpus:
        sb.append(f"--gpus-per-node={gpus}")
    if cfg.cpus_per_task:
        sb.append(f"--cpus-per-task={int(cfg.cpus_per_task)}")
    if cfg.mem:
        sb.append(f"--mem={cfg.mem}")
    if time_limit:
        sb.append(f"--time={time_limit}")
    for key in ("partition", "account", "qos"):
        value = getattr(cfg, key)
        if value:
            sb.append(f"--{key}={value}")
    # a node failure must end the stage (NODE_FAIL, reported; `launch --resume` reruns it, or re-verifies
    # its outputs if its manifest was written), not put the job back in the queue to rerun unseen when
    # the node returns (Slurm requeues batch jobs by default); a site that wants that passes --requeue
    # in sbatch_args, which comes later and wins
    sb.append("--no-requeue")
    # site-specific flags (--constraint=..., --reservation=..., --exclusive): executor.sbatch_args
    sb += [str(a) for a in cfg.sbatch_args]
    sb += [
        f"--output={plan.log_path}",
        f"--error={plan.log_path}",
        "--open-mode=append",
    ]
    lines = ["#!/bin/bash", f"# PTQ launcher: stage {plan.name!s} of run {run_dir}"]
    lines += [f"#SBATCH {_sbatch_arg(a)}" for a in sb]
    lines += ["", "set -e"]

    env = stage_env(plan, cfg)
    env.setdefault("OMP_NUM_THREADS", str(cfg.omp_num_threads))
    env.setdefault("PYTHONUNBUFFERED", "1")
    public, secret = split_secrets(env)   # written into the script / passed through sbatch's environment only
    lines += [f"export {k}={q(v)}" for k, v in public.items()]
    for k in secret:
        lines.append(f"# {k}: secret, passed through sbatch's environment (not written here)")

    setup = list(cfg.setup)
    if setup:
        lines += ["", "# setup (executor.setup)"]
        lines += [str(s) for s in setup]

    port = int(cfg.master_port)
    port_expr = str(port) if port else f"$(( {DERIVED_PORT_BASE} + SLURM_JOB_ID % {DERIVED_PORT_SPAN} ))"
    lines += [
        "",
        'export MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"',
        f"export MASTER_PORT={port_expr}",
        f'echo "[slurm] stage {plan.name} job $SLURM_JOB_ID on $SLURM_JOB_NODELIST: '
        f'{plan.world_size} ranks, master $MASTER_ADDR:$MASTER_PORT, $(date -u +%FT%TZ)"',
        "",
    ]

    srun = ["srun", f"--ntasks={plan.world_size}", f"--ntasks-per-node={ntpn}", "--kill-on-bad-exit=1"]
    srun += [str(a) for a in cfg.srun_args]   # executor.srun_args, e.g. --mpi=pmix
    image = cfg.container_image
    if image:
        srun.append(f"--container-image={q(str(image))}")
        mounts = list(cfg.container_mounts)
        if mounts:
            srun.append(f"--container-mounts={q(','.join(str(m) for m in mounts))}")
    # srun flags on one line, the command on the next: still one shell command
    lines.append(" ".join(srun) + " \\\n    " + " ".join(q(str(a)) for a in plan.argv))
    return "\n".join(lines) + "\n"


def _sbatch_arg(arg: str) -> str:
    # #SBATCH lines are not parsed by a shell: quote only what sbatch's own splitter needs
    key, _, value = arg.partition("=")
    if any(c.isspace() for c in value):
        return f'{key}="{value}"'
    return arg


def dependency_spec(index: int, plans: Sequence[StagePlan], job_ids: Sequence[str]) -> Optional[str]:
    """``--dependency`` of stage ``index`` given the ids of the stages before it (in order).

    The previous stage is ``afterok`` (or ``afterany`` when it may fail).  When it may fail, the
    stage also needs ``afterok`` on the nearest earlier stage that may not: otherwise a stage
    that never ran because *its* dependency failed (and was cancelled) would satisfy
    ``afterany`` and the next stage would run on missing inputs.
    """
    if index == 0:
        return None
    prev = index - 1
    parts = [f"{'afterany' if plans[prev].allow_to_fail else 'afterok'}:{job_ids[prev]}"]
    if plans[prev].allow_to_fail:
        for j in range(prev - 1, -1, -1):
            if not plans[j].allow_to_fail:
                parts.append(f"afterok:{job_ids[j]}")
                break
    return ",".join(parts)
