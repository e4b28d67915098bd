"""Property: what `launch validate` accepts, the later torch-free checks accept too.

For every example, 150 seeded random override sets (PTQ_PROPERTY_CASES=N: N) over the schema's domain (parallel degrees of
every stage, shard modes, dispatchers, recipes and formats, gate bounds and baselines, executor
kind, nodes and time, stage switches, paths that exist or not).  Each composed config is given to
``validate``; when it accepts, everything that happens next without torch must pass as well:

  * the dry-run plan builds (``describe_plan``, ``build_plans``, and each executor's command:
    the local agent's argv, or the sbatch script ``render_sbatch`` renders);
  * every enabled stage's own torch-free pre-checks: its ``ParallelDims``; quantize's recipe
    checks (``validate_recipe`` and the awq-at-EP rule); the mmlu gate's rules
    (``check_gate_config``), batch limits (``resolve_limits``) and shard plan (``plan_shards``,
    with its own invariants); export's layout rule (tp = ep = etp = 1) and format
    (``check_format_name``).

A case validate accepts that a later check rejects fails the test, naming the example and the
overrides.  Configs are composed once per (example, executor) and the overrides applied with
OmegaConf in struct mode (the schema's types still apply) and undone after each case.
"""
from __future__ import annotations

import contextlib
import copy
import glob
import os
import random

from omegaconf import OmegaConf

from conftest import ROOT
from launcher.config.compose import RECIPES_DIR, ConfigError, compose_example, recipe_names
from launcher.config.schema import RecipeConfig
from launcher.config.validate import enabled_stages, stage_dims, validate

# 150 per example (1050 cases; 38 s measured on the 2-core dev machine at load average 7) in `make test`;
# PTQ_PROPERTY_CASES=500 (3500 cases, 106 s at the same load) for a deeper search
CASES_PER_EXAMPLE = int(os.environ.get("PTQ_PROPERTY_CASES", "150"))
SEED = 17
EXAMPLES = sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "examples", "**", "*.yaml"),
                                                              recursive=True))
DEGREES = (1, 1, 1, 2, 3, 4, 8)
WORLDS = (None, None, 1, 2, 4, 6, 8, 16)


def _domain(cfg) -> dict[str, tuple]:
    """key -> values to draw from (valid ones mostly, and some that are not)."""
    here = {"calib": str(cfg.stages.quantize.calib.dataset), "mmlu": str(cfg.stages.mmlu.dataset)}
    dom: dict[str, tuple] = {}
    for stage in ("quantize", "mmlu", "export"):
        for k in ("tp", "pp", "ep", "etp", "cp"):
            dom[f"stages.{stage}.parallel.{k}"] = DEGREES
        dom[f"stages.{stage}.parallel.world_size"] = WORLDS
        dom[f"stages.{stage}.enabled"] = (True, True, True, False)
    dom.update({
        "stages.vllm_smoke.tensor_parallel_size": (1, 1, 2, 3),
        "stages.vllm_smoke.enabled": (False, False, True),
        "stages.vllm_smoke.score_choices": (True, True, False),
        "stages.mmlu.shard_mode": ("auto", "balanced", "lockstep", "dense_dp"),
        "stages.mmlu.allow_unsafe_shard_mode": (False, False, False, True),
        "stages.mmlu.moe_dispatcher": ("alltoall", "allgather"),
        "stages.quantize.moe_dispatcher": ("alltoall", "allgather"),
        "stages.mmlu.baseline": ("none", "recorded", "evaluate"),
        "stages.mmlu.baseline_accuracy": (None, None, 0.7, 1.5),
        "stages.mmlu.lower_bound": (None, 0.3, 0.99, -0.1),
        "stages.mmlu.max_drop": (None, None, 0.05, 2.0),
        "stages.mmlu.fraction": (1.0, 0.5, 0.0),
        "stages.mmlu.batch_size": ("auto", 4, 0),
        "stages.mmlu.max_batch_tokens": (None, None, 4096, 0),
        "stages.mmlu.dataset": (here["mmlu"], here["mmlu"], "/nonexistent/mmlu"),
        "stages.quantize.calib.dataset": (here["calib"], here["calib"], "/nonexistent/calib.jsonl"),
        "stages.export.name": ("hf", "hf", "a/b"),
        "recipe": tuple(recipe_names()),
        "recipe.format": (None, None, None, "nvfp4", "fp8", "none", "int8_sq", "w4a8"),
        "executor.time": ("01:00:00", "30", "2-00:30", "abc"),
        "executor.nodes": (1, 1, 2, 3),
        "executor.device": ("auto", "cpu", "cuda"),
    })
    return dom


def _recipe(name: str):
    return OmegaConf.merge(OmegaConf.structured(RecipeConfig), OmegaConf.load(os.path.join(RECIPES_DIR, f"{name}.yaml")))


def _draw(rng: random.Random, dom: dict, slurm: bool) -> dict:
    """1-5 groups of keys: a stage's whole rank grid (its degrees together), or a single key."""
    keys = [k for k in dom if slurm or k not in ("executor.time", "executor.nodes")]
    groups: dict[str, list[str]] = {}
    for k in keys:
        groups.setdefault(k.rsplit(".", 1)[0] if ".parallel." in k else k, []).append(k)
    out = {}
    for group in rng.sample(sorted(groups), rng.randint(1, 5)):
        out.update({k: rng.choice(dom[k]) for k in groups[group]})
    return out


@contextlib.contextmanager
def _applied(cfg, overrides: dict):
    """``cfg`` with ``overrides`` set (schema types enforced), restored afterwards (no deep copy:
    copying the config cost more than validating it)."""
    saved = [("recipe", copy.deepcopy(cfg.recipe))]
    try:
        for key, value in overrides.items():
            if key == "recipe":
                cfg.recipe = _recipe(value)
            else:
                saved.append((key, OmegaConf.select(cfg, key)))
                OmegaConf.update(cfg, key, value, merge=True)
        yield cfg
    finally:
        for key, value in reversed(saved):
            if key == "recipe":
                cfg.recipe = value
            else:
                OmegaConf.update(cfg, key, value, merge=True)


SHAPES = [(8, 37), (8, 64), (5, 20), (3, 128), (8, 9), (1, 7), (2, 50)]


def later_problems(cfg) -> list[str]:
    """What the dry run and the stages' torch-free pre-checks say about an accepted config."""
    from launcher.executors.local import LocalExecutor
    from launcher.executors.slurm_script import render_sbatch
    from launcher.export.verify_layout import check_format_name
    from launcher.mmlu.batching import resolve_limits
    from launcher.mmlu.gate import check_gate_config
    from launcher.mmlu.sharding import plan_shards
    from launcher.pipeline import build_plans, describe_plan
    from launcher.quant.recipes import check_recipe_layout, declared_algorithm, validate_recipe

    problems = []

    def check(what, fn, *args, **kwargs):
        try:
            fn(*args, **kwargs)
        except (ValueError, AssertionError) as e:   # ScriptError and ConfigError are ValueErrors
            problems.append(f"{what}: {type(e).__name__}: {e}")

    run_dir = "/runs/job/<run_id>"
    check("describe_plan", describe_plan, cfg)
    plans = []
    check("build_plans", lambda: plans.extend(build_plans(cfg, run_dir)))
    for plan in plans:
        if cfg.executor.kind == "slurm":
            check(f"render_sbatch {plan.name}", render_sbatch, plan, cfg.executor, run_dir)
        else:
            check(f"agent_argv {plan.name}", LocalExecutor(cfg.executor, "").agent_argv, plan, 29500)
    stages = enabled_stages(cfg)
    dims = {}
    for s in stages:
        if s != "vllm_smoke":
            check(f"stages.{s} ParallelDims", lambda s=s: dims.setdefault(s, stage_dims(cfg, s)))
    if "quantize" in stages:
        check("quantize validate_recipe", validate_recipe, cfg.recipe)
        known, algorithm = declared_algorithm(cfg.recipe)   # the stage resolves the same config with torch
        if known and algorithm and "quantize" in dims:
            check("quantize check_recipe_layout", check_recipe_layout, {"algorithm": algorithm}, dims["quantize"].ep,
                  cfg.recipe.name)
    if "mmlu" in stages:
        m = cfg.stages.mmlu
        check("mmlu check_gate_config", check_gate_config, m.lower_bound, m.max_drop, m.baseline,
              m.baseline_accuracy)
        check("mmlu resolve_limits", resolve_limits, m.batch_size, m.max_batch_tokens, "cpu")
        if "mmlu" in dims:
            check("mmlu plan_shards", plan_shards, SHAPES, dims["mmlu"], m.shard_mode, m.moe_dispatcher,
                  m.allow_unsafe_shard_mode)
    if "export" in stages:
        d = dims.get("export")
        if d is not None and (d.tp, d.ep, d.etp) != (1, 1, 1):
            problems.append(f"export needs tp=1 ep=1 etp=1, got {d.describe()}")
        check("export check_format_name", check_format_name, cfg.recipe.format)
    return problems


def test_validate_agrees_with_the_dry_run_and_every_stages_prechecks():
    rng = random.Random(SEED)
    failures, accepted, total = [], 0, 0
    for example in EXAMPLES:
        bases = {kind: compose_example(os.path.join(ROOT, example), [f"executor={kind}"]) for kind in ("local", "slurm")}
        dom = _domain(bases["local"])
        for _ in range(CASES_PER_EXAMPLE):
            kind = rng.choice(("local", "local", "slurm"))
            overrides = _draw(rng, dom, kind == "slurm")
            total += 1
            check_paths = rng.random() < 0.3
            try:
                with _applied(bases[kind], overrides) as cfg:
                    validate(cfg, check_paths=check_paths)
                    accepted += 1
                    problems = later_problems(cfg)
            except ConfigError:
                continue
            except ValueError as e:   # omegaconf's own type errors are ValueErrors: a refusal too
                if "ValidationError" in type(e).__name__:
                    continue
                raise
            if problems:
                failures.append(f"{example} executor={kind} {overrides}:\n    " + "\n    ".join(problems))
        # every case was undone: the cases were what they say
        fresh = compose_example(os.path.join(ROOT, example), ["executor=slurm"])
        assert OmegaConf.to_container(bases["slurm"]) == OmegaConf.to_container(fresh), example
    print(f"validate accepted {accepted} of {total} cases")
    assert not failures, f"{len(failures)} accepted case(s) fail later:\n" + "\n".join(failures[:15])
    assert total == CASES_PER_EXAMPLE * len(EXAMPLES) >= 500
    assert accepted >= total // 10, f"only {accepted} of {total} cases were valid: the domain is too hostile"
