"""Property: what `launch validate` accepts, the later torch-free checks accept too.

For every example, 150 seeded random override sets (PTQ_PROPERTY_CASES=N: N) over the schema's domain (parallel degrees of
every stage, shard modes, dispatchers, recipes, both recipe keys and formats, dtypes, gate bounds and baselines, executor
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
overrides.  Then, for every key of the schema, values its rule refuses (just outside a range, a
path of the wrong kind, a bogus choice): validate refuses each, naming the key.  Configs are composed once per (example, executor) and the overrides applied with
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
from launcher.config.compose import ConfigError, compose_example
from launcher.paths import RECIPES_DIR, recipe_names
from launcher.config.validate import validate
from launcher.schema import RecipeConfig, enabled_stages
from launcher.topology import ParallelDims

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
        # both recipe keys: exactly one must be set (the quantize stage's validate_recipe decides)
        "recipe.modelopt_cfg": (None, "NVFP4_DEFAULT_CFG", "FP8_DEFAULT_CFG"),
        "recipe.recipe_path": (None, None, "general/ptq/nvfp4_mlp_weight_only"),
        "stages.quantize.dtype": ("bfloat16", "float16", "float32"),
        "stages.export.dtype": ("bfloat16", "float16", "float32"),
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
            check(f"stages.{s} ParallelDims", lambda s=s: dims.setdefault(s, ParallelDims.from_stage(cfg, s)))
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


# --- every key: an invalid value of each is refused by validate, naming the key -------------------
# A key whose rule is a library's checker (rules.Owned) gets its invalid value here; a new owned key
# without one fails test_every_schema_key_states_what_is_valid.
OWNED_INVALID = {
    "model.architecture": "MixtralForCausalLM",
    "model.hybrid_pattern": "MXE*",
    "recipe.modelopt_cfg": "NVFP4_BOGUS_CFG",
    "recipe.recipe_path": "/nonexistent/recipe.yaml",
    "executor.kind": None,                      # the config group picks it; `executor=bogus` is refused at compose
    "executor.time": "1h",
    "stages.mmlu.batch_size": "eight",
    "stages.mmlu.lower_bound": 1.5,
    "stages.mmlu.max_drop": -0.1,
    "stages.mmlu.baseline_accuracy": 2.0,
}


def schema_keys() -> list[tuple[str, object, type, str]]:
    """(dotted key, dataclass field, type hint, executor kind) of every leaf key of the schema."""
    import dataclasses
    import typing

    from launcher.config.compose import EXECUTOR_SCHEMAS
    from launcher.schema import PipelineConfig

    out = []

    def walk(cls, prefix, kind):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            hint = hints[f.name]
            if f.name == "executor" and not prefix:
                for name, executor in sorted(EXECUTOR_SCHEMAS.items()):
                    walk(executor, "executor.", name)
            elif dataclasses.is_dataclass(hint):
                walk(hint, f"{prefix}{f.name}.", kind)
            else:
                out.append((prefix + f.name, f, hint, kind))

    walk(PipelineConfig, "", "local")
    return out


def _base_type(hint):
    import typing

    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if typing.get_origin(hint) is typing.Union and len(args) == 1 else hint


def _is_enum(hint) -> bool:
    import enum

    t = _base_type(hint)
    return isinstance(t, type) and issubclass(t, enum.Enum)


def invalid_values(key, f, hint, tmp) -> list:
    """Values of the key's own type that its rule refuses (none for booleans, lists, free text)."""
    import re

    from launcher import schema_rules as rules

    rule = rules.rule_of(f)
    if isinstance(rule, rules.Range):
        return rule.invalid()
    if isinstance(rule, rules.Path):
        a_file, a_dir = tmp / "a_file", tmp / "a_dir"
        a_file.write_text("x")
        a_dir.mkdir(exist_ok=True)
        wrong_kind = {"dir": [str(a_file)], "file": [str(a_dir)], "any": []}[rule.kind]
        return wrong_kind + ([str(tmp / "missing" / "path")] if rule.exists else [str(a_file / "below")])
    if isinstance(rule, rules.Pattern):
        return [v for v in ("", "a b/c") if not re.fullmatch(rule.regex, v)]
    if isinstance(rule, rules.Owned):
        return [] if OWNED_INVALID[key] is None else [OWNED_INVALID[key]]
    return []


def test_every_schema_key_states_what_is_valid():
    """Numbers have a Range (or a checker that owns them), paths a kind, strings a rule; choices are
    Enums; only booleans, lists and mappings go without."""
    from launcher import schema_rules as rules

    bare = []
    for key, f, hint, _ in schema_keys():
        rule, t = rules.rule_of(f), _base_type(hint)
        if _is_enum(hint) or t is bool or getattr(t, "__origin__", t) in (list, dict):
            assert rule is None, f"{key}: an Enum/bool/list key needs no rule"
        elif rule is None:
            bare.append(key)
        elif t in (int, float):
            assert isinstance(rule, (rules.Range, rules.Owned)), f"{key}: a number needs a Range, got {rule}"
        if isinstance(rule, rules.Owned):
            assert key in OWNED_INVALID, f"{key}: owned by {rule.owner}, but no invalid value is drawn for it"
    assert bare == [], f"keys that do not say what is valid: {bare}"


def test_validate_refuses_an_invalid_value_of_every_key_naming_it(tmp_path):
    """Each key, set to each value its rule refuses (on the tiny example with real files, so
    paths are checked), is refused by validate with a line that names the key."""
    from test_bad_inputs import TINY, Inputs

    inputs = Inputs(tmp_path)
    overrides = inputs.validate()[2:]
    bases = {kind: compose_example(TINY, [f"executor={kind}", *overrides]) for kind in ("local", "slurm")}
    validate(bases["slurm"])
    drawn, missed = 0, []
    for key, f, hint, kind in schema_keys():
        if _is_enum(hint):
            continue   # refused at compose: the next test
        for value in invalid_values(key, f, hint, tmp_path):
            drawn += 1
            with _applied(bases[kind], {key: value}) as cfg:
                try:
                    validate(cfg, check_paths=True)
                    missed.append(f"{key}={value!r}: accepted")
                except ConfigError as e:
                    if not any(line.strip().startswith(key + "=") or f" {key} " in line or f"{key}," in line
                               for line in str(e).splitlines()):
                        missed.append(f"{key}={value!r}: refused without naming the key: {e}")
    assert missed == []
    assert drawn >= 60, drawn


def test_launch_validate_refuses_a_bogus_value_of_every_choice_key(capsys):
    from launcher.cli import main
    from test_bad_inputs import TINY

    keys = [(key, kind) for key, f, hint, kind in schema_keys() if _is_enum(hint)]
    assert len(keys) >= 12
    for key, kind in keys:
        assert main(["validate", TINY, "--no-check-paths", f"executor={kind}", f"{key}=bogus"]) == 2, key
        err = capsys.readouterr().err
        assert err.startswith(f"launch: {key}='bogus': ") and "valid" in err and "Traceback" not in err, err
