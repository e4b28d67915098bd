"""`python -m launcher.worker STAGE RUN_DIR [--preflight-only]`: what every rank runs.

Reads RUN_DIR/config.yaml, initializes torch.distributed + Megatron-Core parallel_state at the
stage's degrees, runs the preflight, then the stage's ``run(ctx)`` (launcher.stages.registry).  Rank 0 writes
the stage's manifest on success (and removes an older one before the work starts); a test can hold
the ranks before and after the work (launcher.hold, off by default).  Exit codes:
launcher.contract.ExitCode (1 failed, 3 gate failed, 4 desync, 5 preflight).
"""
from __future__ import annotations

import os
import sys
import time
import traceback

from launcher.contract import ExitCode, RunLayout, StageFailed, StageName, UserError, report_user_error


def share_kernel_caches(cache_root: str, env=os.environ) -> dict[str, str]:
    """Point triton's and inductor's on-disk caches at ``<cache>/kernels`` (unless the user set
    them), with triton's autotune results cached too: every stage of a run, and every run on the
    machine, reuses the kernels (the Mamba-2 scan, the fused SwiGLU) that an earlier stage compiled
    and tuned instead of paying the JIT again.  Returns what it set."""
    wanted = {"TRITON_CACHE_DIR": os.path.join(cache_root, "kernels", "triton"),
              "TRITON_CACHE_AUTOTUNING": "1",
              "TORCHINDUCTOR_CACHE_DIR": os.path.join(cache_root, "kernels", "inductor")}
    chosen = {k: v for k, v in wanted.items() if not env.get(k)}
    env.update(chosen)
    return chosen


def choose_device(requested: str, local_world: int) -> str:
    if requested == "cpu":
        # CPU ranks never see a GPU (the executors start them so too): the CPU shims refuse a
        # process where CUDA is visible, and torch must not initialise CUDA behind their back.
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        return "cpu"
    import torch

    has_cuda = torch.cuda.is_available() and torch.cuda.device_count() >= local_world
    if requested == "cuda" and not has_cuda:
        raise RuntimeError(f"executor.device=cuda but this node has {torch.cuda.device_count()} GPU(s) for "
                           f"{local_world} local rank(s)")
    return "cuda" if has_cuda else "cpu"


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return ExitCode.USAGE
    stage, run_dir = argv[0], os.path.abspath(argv[1])
    preflight_only = "--preflight-only" in argv[2:]
    # Environment first: set by the local agent, or derived from srun's.
    from launcher.slurm_env import rendezvous_defaults
    from launcher.megatron.dist import rank_env  # no torch import at module level

    env = rank_env()
    rank, world, local_rank = env["rank"], env["world_size"], env["local_rank"]
    for name, value in rendezvous_defaults(os.environ).items():   # under srun: first node, job-id port
        os.environ.setdefault(name, value)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(local_rank),
                      NODE_RANK=str(env["node_rank"]))
    from launcher.executors.rank_start import name_process

    name_process(f"{stage}:r{rank}")   # `ps`/`top` tell ranks apart (a forked rank's command line is its agent's)
    if env["num_nodes"] == 1:   # across nodes, loopback is never right: init_distributed says what is missing
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")

    from launcher.config.compose import load_run_config
    from launcher.topology import ParallelDims
    from launcher.stages import registry
    from launcher.stages.context import StageContext

    from launcher.paths import cache_dir

    share_kernel_caches(cache_dir())   # before the first compile (triton and inductor read them lazily)
    cfg = load_run_config(RunLayout(run_dir).config_yaml)
    dims = ParallelDims.from_stage(cfg, stage)
    if world != dims.world_size:
        print(f"[{stage} r{rank}] started with WORLD_SIZE={world} but the stage's plan (stages.{stage}) needs "
              f"{dims.world_size} ranks", file=sys.stderr, flush=True)
        return ExitCode.PREFLIGHT
    local_world = env["local_world_size"]
    device = choose_device(cfg.executor.device, local_world)
    # the gate has its own (short) timeout for its guard and collectives; every other stage the executor's
    timeout_s = float((cfg.stages.mmlu.collective_timeout_s if stage == StageName.MMLU else None)
                      or cfg.executor.collective_timeout_s)
    ctx = StageContext(name=stage, cfg=cfg, run_dir=run_dir, rank=rank, world_size=world,
                       local_rank=local_rank, dims=dims, device=device)
    t0 = time.time()
    spec = registry.get(stage)
    if not spec.needs_megatron:
        return 0 if preflight_only else _run_stage(spec, ctx, cfg, run_dir, rank, world, device, t0, shutdown=None)
    from launcher.megatron import dist as mdist
    from launcher.preflight import PreflightError, run_preflight

    try:
        mdist.init_distributed(dims, device, max(timeout_s, float(cfg.executor.collective_timeout_s)), cfg.seed,
                               architecture=cfg.model.architecture)
        run_preflight(dims, rank)
        where = ""
        if env["num_nodes"] > 1:
            gloo = os.environ.get("GLOO_SOCKET_IFNAME")
            where = (f" across {env['num_nodes']} nodes (master {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
                     + (f", gloo via {gloo})" if gloo and device == "cpu" else ")"))
        ctx.log(f"preflight ok: {dims.describe()} on {device}{where} ({time.time() - t0:.1f}s)")
    except (PreflightError, RuntimeError, ValueError) as e:
        print(f"[{stage} r{rank}] PREFLIGHT FAILED: {e}", file=sys.stderr, flush=True)
        return ExitCode.PREFLIGHT
    if preflight_only:
        mdist.shutdown()
        return 0
    return _run_stage(spec, ctx, cfg, run_dir, rank, world, device, t0, shutdown=mdist.shutdown)


def _run_stage(spec, ctx, cfg, run_dir, rank, world, device, t0, shutdown) -> int:
    from launcher import hold, profiling
    from launcher.megatron import patches
    from launcher.rundir import remove_manifest, write_manifest

    stage = spec.name
    if rank == 0:
        remove_manifest(run_dir, stage)
    try:
        hold.at(stage, "start", rank, log=lambda m: ctx.log(m, all_ranks=True))
        with profiling.maybe_profile(stage, rank, run_dir) as profiled:   # PTQ_PROFILE=<stage>
            if profiled:
                ctx.log(f"profiling ({profiling.ENV}): {profiling.profile_paths(run_dir, stage, rank)[1]}")
            spec.run(ctx)
    except StageFailed as e:
        print(f"[{stage} r{rank}] STAGE FAILED: {e}", file=sys.stderr, flush=True)
        _flush_and_exit(e.exit_code)
    except UserError as e:   # the user's input: its lines on the console, the traceback in the log only
        report_user_error(f"[{stage} r{rank}]", e, RunLayout(run_dir).log(stage), traceback.format_exc(),
                          sys.stderr)
        _flush_and_exit(ExitCode.FAILED)
    except Exception as e:  # noqa: BLE001 - every rank reports its own traceback, then exits non-zero
        # the first line says what (the Slurm executor reports it): e.g. gloo's "Connection closed by peer [addr]"
        what = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}"
        print(f"[{stage} r{rank}] STAGE FAILED with an exception: {what}\n{traceback.format_exc()}",
              file=sys.stderr, flush=True)
        _flush_and_exit(ExitCode.FAILED)
    if rank == 0:
        write_manifest(run_dir, cfg, stage, {"duration_s": round(time.time() - t0, 2), "world_size": world,
                                             "device": device, "patches": patches.applied_in_process()})
    try:
        hold.at(stage, "end", rank, log=lambda m: ctx.log(m, all_ranks=True))
    except hold.HoldTimeout as e:
        print(f"[{stage} r{rank}] STAGE FAILED: {e}", file=sys.stderr, flush=True)
        _flush_and_exit(ExitCode.FAILED)
    try:
        if shutdown is not None:
            shutdown()
    except Exception:  # noqa: BLE001 - shutting down after success must not fail the stage
        pass
    ctx.log(f"done in {time.time() - t0:.1f}s")
    return 0


def _flush_and_exit(code: int) -> None:
    """Exit at once: peers may be blocked in collectives; the agent tears them down."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
