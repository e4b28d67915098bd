"""Validation of a composed pipeline config, before any process starts (no torch).

Validation is the schema's types and rules (``launcher.schema_rules``: ranges, path kinds,
syntaxes; Enums refuse at compose), the cross-key rules below (parallel layout, stage wiring),
and the libraries' own torch-free checkers: the recipe's (``quant.recipes.validate_recipe`` and
``quant.recipe_yaml``), the gate's (``mmlu.gate.check_gate_config``), the batch size's, and the
readers of what the config names (``mmlu.data.check_contents``, ``quant.calibration.check_contents``,
``hf_config.config_json_problems``).  Every problem is collected, then raised together as
one ConfigError; each line names the key, the value and what would be valid.
``check_paths=False`` (CI's example check, dry runs on a login node) skips checks that need
checkpoints and datasets on this machine.
"""
from __future__ import annotations

import os
from typing import Any

from omegaconf import DictConfig

from launcher import schema, schema_rules as rules
from launcher.architectures import SUPPORTED, is_hybrid, tp_problem
from launcher.config.compose import ConfigError
from launcher.config.hf_card import card_from_hf_config
from launcher.hf_config import PATTERN_SYMBOLS, hybrid_layers, nemotron_h_unsupported, read_hf_config_if_present
from launcher.paths import recipe_names
from launcher.schema import enabled_stages
from launcher.topology import ParallelDims


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


class _Errors:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def add(self, key: str, value: Any, problem: str) -> None:
        self.lines.append(f"{key}={value!r}: {problem}")


def validate(cfg: DictConfig, check_paths: bool = True) -> list[str]:
    """Raise ConfigError listing every problem; return warnings (e.g. paths not checked)."""
    err = _Errors()
    warnings: list[str] = []
    for key, value, problem in rules.problems(cfg, check_paths):
        err.add(key, value, problem)
    _check_model(cfg, err, check_paths)
    if _check_recipe(cfg, err) and cfg.stages.quantize.enabled:
        _check_calibration_at_ep(cfg, err)
    _check_executor(cfg, err)
    for key in cfg.env or {}:
        if str(key).startswith("PTQ_TEST_"):   # launcher.hold: a test's hook, never a config's
            err.add(f"env.{key}", cfg.env[key], "PTQ_TEST_* variables are test hooks (launcher/hold.py); "
                    "a config may not set them")
    if not enabled_stages(cfg):
        err.add("stages", "all disabled", "enable at least one of " + ", ".join(schema.STAGE_ORDER))
    for stage in enabled_stages(cfg):
        if stage != "vllm_smoke":  # vLLM shards itself: stages.vllm_smoke.tensor_parallel_size
            _check_parallel(cfg, stage, err)
    _check_mmlu(cfg, err, warnings, check_paths)
    _check_export(cfg, err)
    _check_vllm(cfg, err)
    _check_slurm_nodes(cfg, err)
    if check_paths:   # what the files the config names hold (those whose path passed)
        from launcher.config.contents import content_problems

        err.lines.extend(content_problems(cfg, {line.split("=", 1)[0] for line in err.lines}))
    if err.lines:
        raise ConfigError("invalid config:\n  " + "\n  ".join(err.lines))
    return warnings


def _check_model(cfg: DictConfig, err: _Errors, check_paths: bool) -> None:
    card = cfg.model
    if card.architecture not in SUPPORTED:
        err.add("model.architecture", card.architecture, f"not supported; valid: {', '.join(SUPPORTED)}")
    if card.num_attention_heads >= 1 and card.num_query_groups >= 1 and card.num_attention_heads % card.num_query_groups:
        err.add("model.num_query_groups", card.num_query_groups,
                f"must divide model.num_attention_heads={card.num_attention_heads}")
    if card.num_experts and not 1 <= card.moe_topk <= card.num_experts:
        err.add("model.moe_topk", card.moe_topk, f"must be in 1..model.num_experts={card.num_experts}")
    if card.hybrid_pattern is not None:
        layers = hybrid_layers(card.hybrid_pattern)
        bad = sorted(set(layers) - set(PATTERN_SYMBOLS))
        if bad:
            err.add("model.hybrid_pattern", card.hybrid_pattern,
                    f"has symbols {bad}; valid: {list(PATTERN_SYMBOLS)} (M mamba, E MoE, * attention, - MLP) "
                    "and '|' between pipeline stages")
        elif len(layers) != card.num_layers:
            err.add("model.hybrid_pattern", card.hybrid_pattern,
                    f"has {len(layers)} layers but model.num_layers={card.num_layers}")
    elif is_hybrid(card.architecture):
        err.add("model.hybrid_pattern", None, f"{card.architecture} needs its layer pattern (config.json "
                "hybrid_override_pattern, e.g. 'MEM*E'); set it, or use model=from_checkpoint")
    try:
        hf = read_hf_config_if_present(card.path)
        derived = None if hf is None else card_from_hf_config(hf)
    except ValueError as e:
        err.add("model.path", card.path, str(e))
        return
    if hf is None:
        if check_paths and os.path.isdir(card.path):
            err.add("model.path", card.path, "no config.json there (a local Hugging Face checkpoint directory)")
        return
    if is_hybrid(derived.get("architecture")):
        for problem in nemotron_h_unsupported(hf):
            err.add("model.path", card.path, problem)
    for key, value in derived.items():
        if key == "vocab_size" and card.vocab_size is None:
            continue
        if card[key] != value:
            err.add(f"model.{key}", card[key], f"the checkpoint's config.json says {value!r} ({card.path})")


def _check_recipe(cfg: DictConfig, err: _Errors) -> bool:
    """The recipe's own checker (what the quantize stage runs first), then its YAML's content;
    True when both accept it."""
    from launcher.quant.recipe_yaml import check_modelopt_cfg, check_recipe_file
    from launcher.quant.recipes import validate_recipe

    r = cfg.recipe
    try:
        validate_recipe(r)
    except ValueError as e:
        err.lines.append(str(e) + ("" if r.modelopt_cfg or r.recipe_path or r.format == "none"
                                   else f"; recipes: {', '.join(recipe_names())}"))
        return False
    problems = check_recipe_file(r.recipe_path) if r.recipe_path else \
        check_modelopt_cfg(r.modelopt_cfg) if r.modelopt_cfg else []
    err.lines.extend(problems)
    return not problems


def _check_executor(cfg: DictConfig, err: _Errors) -> None:
    ex = cfg.executor
    if ex.kind == "slurm":
        from launcher.executors.slurm_script import TIME_SYNTAX, valid_time

        if not valid_time(str(ex.time or "")):
            err.add("executor.time", ex.time, f"valid: {TIME_SYNTAX} (Slurm's --time syntax)")


def _check_slurm_nodes(cfg: DictConfig, err: _Errors) -> None:
    """executor.nodes must split every enabled stage's ranks evenly over the nodes it runs on."""
    from launcher.executors.slurm_script import stage_nodes

    ex = cfg.executor
    if ex.kind != "slurm" or ex.nodes < 1:
        return
    for stage in enabled_stages(cfg):
        try:
            world = ParallelDims.from_stage(cfg, stage).world_size
        except ValueError:
            continue   # the stage's own parallel errors are reported already
        n = stage_nodes(world, ex.nodes)
        if world % n:
            err.add("executor.nodes", ex.nodes,
                    f"stages.{stage} has {world} ranks, which do not split evenly over {n} nodes "
                    f"(valid: {', '.join(map(str, divisors(world)))})")


def _check_parallel(cfg: DictConfig, stage: str, err: _Errors) -> None:
    p = cfg.stages[stage].parallel
    key = f"stages.{stage}.parallel"
    card = cfg.model
    if min(p.tp, p.pp, p.ep, p.etp, p.cp) < 1 or (p.world_size is not None and p.world_size < 1):
        return   # the schema's ranges report it
    if card.num_experts:
        if card.num_experts % p.ep:
            err.add(f"{key}.ep", p.ep, f"must divide model.num_experts={card.num_experts} "
                    f"(valid: {', '.join(map(str, divisors(card.num_experts)))})")
    elif p.ep != 1 or p.etp != 1:
        err.add(f"{key}.ep", p.ep, f"model {card.name} is dense (no experts): ep and etp must be 1")
    segments = card.hybrid_pattern.split("|") if card.hybrid_pattern else []
    if len(segments) > 1:
        # Megatron's hybrid rule: pipe-delimited segments are the stages (no virtual PP here)
        if len(segments) != p.pp:
            err.add(f"{key}.pp", p.pp, f"must equal the {len(segments)} '|'-delimited stages of "
                    f"model.hybrid_pattern={card.hybrid_pattern!r}")
        elif not all(segments):
            err.add("model.hybrid_pattern", card.hybrid_pattern, "has an empty pipeline stage between '|'")
    elif card.num_layers % p.pp:
        what = "the hybrid pattern's " if card.hybrid_pattern else "model.num_layers="
        err.add(f"{key}.pp", p.pp, f"must divide {what}{card.num_layers} layers: Megatron gives every "
                f"pipeline stage the same number of whole layers "
                f"(valid: {', '.join(map(str, divisors(card.num_layers)))})")
    if why := tp_problem(card.architecture, p.tp):
        err.add(f"{key}.tp", p.tp, why)
    for dim in ("num_attention_heads", "num_query_groups"):
        if card[dim] % p.tp:
            err.add(f"{key}.tp", p.tp, f"must divide model.{dim}={card[dim]} "
                    f"(valid: {', '.join(map(str, divisors(card[dim])))})")
    try:   # the rank grid every rank builds: world = tp*cp*dp*pp = etp*ep*edp*pp (ParallelDims' rule)
        ParallelDims.from_stage(cfg, stage)
    except ValueError as e:
        err.add(f"{key}.world_size", p.world_size, str(e))


def _check_calibration_at_ep(cfg: DictConfig, err: _Errors) -> None:
    """The quantize stage's recipe_layout check, decided from the recipe's YAML (no torch)."""
    from launcher.quant.recipes import EP_UNSAFE_ALGORITHMS, declared_algorithm

    ep = cfg.stages.quantize.parallel.ep
    if ep <= 1:
        return
    known, algorithm = declared_algorithm(cfg.recipe)
    if known and algorithm in EP_UNSAFE_ALGORITHMS:
        err.add("stages.quantize.parallel.ep", ep,
                f"recipe {cfg.recipe.name!r} calibrates with {algorithm!r}, which desyncs expert-parallel ranks "
                f"in ModelOpt's implementation (collectives depend on per-rank expert token counts); valid: "
                f"stages.quantize.parallel.ep=1, or a recipe calibrated with another algorithm (e.g. max)")


def _check_mmlu(cfg: DictConfig, err: _Errors, warnings: list[str], check_paths: bool) -> None:
    from launcher.mmlu.batching import check_batch_size
    from launcher.mmlu.gate import check_gate_config  # pure Python
    from launcher.mmlu.sharding import resolve_mode

    m = cfg.stages.mmlu
    if not m.enabled:
        return
    key = "stages.mmlu"
    for check, args in ((check_gate_config, (m.lower_bound, m.max_drop, m.baseline, m.baseline_accuracy)),
                        (check_batch_size, (m.batch_size,)),
                        (resolve_mode, (m.shard_mode, m.parallel.ep, m.allow_unsafe_shard_mode))):
        try:
            check(*args)
        except ValueError as e:   # their messages name the key and the valid values
            err.lines.append(str(e))
    if m.baseline == "cached" and check_paths:
        from launcher.mmlu import baseline_cache  # pure Python: reads the cache's JSON entries

        where = baseline_cache.resolve_dir(m.baseline_cache_dir)
        if not baseline_cache.entries_for_model(where, cfg.model.path):
            err.add(f"{key}.baseline", m.baseline,
                    f"no cached baseline for model.path={cfg.model.path} in {where}; run once with "
                    f"stages.mmlu.baseline=evaluate (or set stages.mmlu.baseline_cache_dir)")
    if m.lower_bound is None and m.max_drop is None:
        warnings.append("stages.mmlu has neither lower_bound nor max_drop: the gate always passes")
    if not check_paths and m.few_shots and m.dataset.endswith(".jsonl") and not m.dev_dataset:
        err.add(f"{key}.few_shots", m.few_shots, "a jsonl dataset has no dev split: set stages.mmlu.dev_dataset")
    if not cfg.stages.quantize.enabled and cfg.recipe.format != "none":
        warnings.append("stages.mmlu evaluates the unquantized checkpoint: stages.quantize is disabled")


def _check_export(cfg: DictConfig, err: _Errors) -> None:
    e = cfg.stages.export
    if not e.enabled:
        return
    why = "ModelOpt's Megatron->HF export silently corrupts at tp>1 (empty tensors) and ep>1 (drops experts)"
    for dim in ("tp", "ep", "etp"):
        if e.parallel[dim] != 1:
            err.add(f"stages.export.parallel.{dim}", e.parallel[dim], f"must be 1: {why}; use pp to spread the model")
    if not cfg.stages.quantize.enabled and cfg.recipe.format != "none":
        err.add("stages.export.enabled", True,
                f"exporting recipe {cfg.recipe.name!r} needs stages.quantize's checkpoint; enable stages.quantize "
                "or use recipe=none")


def _check_vllm(cfg: DictConfig, err: _Errors) -> None:
    v = cfg.stages.vllm_smoke
    key = "stages.vllm_smoke"
    if not v.enabled:
        return
    if v.score_choices and not cfg.stages.mmlu.enabled:
        err.add(f"{key}.score_choices", True,
                "compares vLLM with the gate's mmlu/results.json: enable stages.mmlu, or set "
                "stages.vllm_smoke.score_choices=false (generation checks only)")
    if not v.score_choices and not v.prompts:
        err.add(f"{key}.prompts", v.prompts,
                "nothing to check with score_choices=false: give a jsonl of generation checks")
    # vLLM splits attention heads over its tensor-parallel workers, all on the node of the stage's rank
    tp, heads = v.tensor_parallel_size, cfg.model.num_attention_heads
    if tp >= 1 and heads % tp:
        err.add(f"{key}.tensor_parallel_size", tp, f"must divide model.num_attention_heads={heads} "
                f"(valid: {', '.join(map(str, divisors(heads)))})")
    gpus = cfg.executor.gpus_per_node if cfg.executor.kind == "slurm" else 0
    if gpus and tp > gpus:
        err.add(f"{key}.tensor_parallel_size", tp, f"vLLM's workers share one node, which has executor.gpus_per_node={gpus}")
    if not cfg.stages.export.enabled and not v.model_dir:
        err.add("stages.vllm_smoke.enabled", True,
                "serves stages.export's checkpoint: enable stages.export or set stages.vllm_smoke.model_dir")
    if v.nvfp4_kernels == "emulation" and not v.model_dir and cfg.recipe.format != "nvfp4":
        err.add(f"{key}.nvfp4_kernels", "emulation", f"serves NVFP4 exports; recipe {cfg.recipe.name} exports "
                f"{cfg.recipe.format} (valid here: auto)")
