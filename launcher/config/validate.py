"""Validation of a composed pipeline config, before any process starts (no torch).

Every problem is collected, then raised together as one ConfigError; each line names the key,
the value and what would be valid.  ``check_paths=False`` (CI's example check, dry runs on a
login node) skips checks that need checkpoints and datasets on this machine.
"""
from __future__ import annotations

import os
import re
from typing import Any

from omegaconf import DictConfig

from launcher import formats
from launcher.config import schema
from launcher.config.compose import ConfigError, recipe_names
from launcher.config.hf_card import (
    HYBRID_ARCHITECTURES, PATTERN_SYMBOLS, card_from_hf_config, hybrid_layers, nemotron_h_unsupported,
    read_hf_config)
from launcher.topology import ParallelDims, minimal_world_size

SUPPORTED_ARCHITECTURES = ("Qwen3MoeForCausalLM", "Qwen3ForCausalLM", "LlamaForCausalLM", "NemotronHForCausalLM")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_JOB_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def is_hub_id(value: str) -> bool:
    """'org/name' that is not a path on this machine."""
    return bool(_HUB_ID.match(value)) and not os.path.exists(value) and not value.startswith((".", "/"))


def stage_dims(cfg: DictConfig, stage: str) -> ParallelDims:
    """ParallelDims of a stage (world size defaulted to the smallest the degrees divide); vllm_smoke
    is one launcher rank (vLLM starts its own tensor-parallel workers)."""
    if stage == "vllm_smoke":
        return ParallelDims(world_size=1)
    p = cfg.stages[stage].parallel
    world = p.world_size or minimal_world_size(p.tp, p.pp, p.cp, p.ep, p.etp)
    return ParallelDims(world_size=world, tp=p.tp, pp=p.pp, cp=p.cp, ep=p.ep, etp=p.etp)


def enabled_stages(cfg: DictConfig) -> list[str]:
    return [s for s in schema.STAGE_ORDER if cfg.stages[s].enabled]


class _Errors:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def add(self, key: str, value: Any, problem: str) -> None:
        self.lines.append(f"{key}={value!r}: {problem}")


def validate(cfg: DictConfig, check_paths: bool = True) -> list[str]:
    """Raise ConfigError listing every problem; return warnings (e.g. paths not checked)."""
    err = _Errors()
    warnings: list[str] = []
    if not _JOB_NAME.match(str(cfg.job_name)):
        err.add("job_name", cfg.job_name, "use letters, digits, '.', '_' and '-' (it names the run directory)")
    if cfg.test_level < 0:
        err.add("test_level", cfg.test_level, "must be >= 0")
    _check_model(cfg, err, warnings, check_paths)
    _check_recipe(cfg, err)
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
            _check_rank_grid(cfg, stage, err)
    _check_quantize(cfg, err, warnings, check_paths)
    _check_mmlu(cfg, err, warnings, check_paths)
    _check_export(cfg, err)
    _check_vllm(cfg, err, warnings, check_paths)
    _check_slurm_nodes(cfg, err)
    if err.lines:
        raise ConfigError("invalid config:\n  " + "\n  ".join(err.lines))
    return warnings


def _check_model(cfg: DictConfig, err: _Errors, warnings: list[str], check_paths: bool) -> None:
    card = cfg.model
    if card.architecture not in SUPPORTED_ARCHITECTURES:
        err.add("model.architecture", card.architecture, f"not supported; valid: {', '.join(SUPPORTED_ARCHITECTURES)}")
    for key in ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups"):
        if card[key] < 1:
            err.add(f"model.{key}", card[key], "must be >= 1")
    if card.num_attention_heads >= 1 and card.num_query_groups >= 1 and card.num_attention_heads % card.num_query_groups:
        err.add("model.num_query_groups", card.num_query_groups,
                f"must divide model.num_attention_heads={card.num_attention_heads}")
    if card.num_experts < 0 or (card.num_experts and not 1 <= card.moe_topk <= card.num_experts):
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
    elif card.architecture in HYBRID_ARCHITECTURES:
        err.add("model.hybrid_pattern", None, f"{card.architecture} needs its layer pattern (config.json "
                "hybrid_override_pattern, e.g. 'MEM*E'); set it, or use model=from_checkpoint")
    try:
        hf = read_hf_config(card.path)
        derived = None if hf is None else card_from_hf_config(hf)
    except ValueError as e:
        err.add("model.path", card.path, str(e))
        return
    if hf is not None and derived.get("architecture") in HYBRID_ARCHITECTURES:
        for problem in nemotron_h_unsupported(hf):
            err.add("model.path", card.path, problem)
    if hf is None:
        if check_paths and not is_hub_id(card.path):
            err.add("model.path", card.path, "no config.json there (a local Hugging Face checkpoint directory)")
        elif not check_paths:
            warnings.append(f"model.path={card.path!r} not checked (check_paths off)")
        return
    for key, value in derived.items():
        if key == "vocab_size" and card.vocab_size is None:
            continue
        if card[key] != value:
            err.add(f"model.{key}", card[key], f"the checkpoint's config.json says {value!r} ({card.path})")


def _check_recipe(cfg: DictConfig, err: _Errors) -> None:
    r = cfg.recipe
    problem = formats.format_problem(r.format)
    if problem:
        err.add("recipe.format", r.format, problem)
    if r.format == "none":
        if r.modelopt_cfg or r.recipe_path:
            err.add("recipe.modelopt_cfg", r.modelopt_cfg, "must be null for format none")
    elif not r.modelopt_cfg and not r.recipe_path:
        err.add("recipe", r.name, f"set recipe.modelopt_cfg or recipe.recipe_path; recipes: {', '.join(recipe_names())}")
    if r.recipe_path and not os.path.isfile(r.recipe_path) and not _modelopt_builtin_recipe(r.recipe_path):
        err.add("recipe.recipe_path", r.recipe_path,
                "neither a file nor a ModelOpt built-in recipe (modelopt_recipes/<name>.yaml, e.g. general/ptq/...)")


def _modelopt_builtin_recipe(name: str) -> bool:
    """``name`` is one of ModelOpt's built-in recipes (found in the modelopt_recipes package, not imported)."""
    import importlib.util

    spec = importlib.util.find_spec("modelopt_recipes")
    roots = list(spec.submodule_search_locations or []) if spec is not None else []
    return any(os.path.isfile(os.path.join(root, name + suffix)) for root in roots for suffix in ("", ".yaml", ".yml"))


def _check_executor(cfg: DictConfig, err: _Errors) -> None:
    ex = cfg.executor
    if ex.device not in schema.DEVICES:
        err.add("executor.device", ex.device, f"valid: {', '.join(schema.DEVICES)}")
    if ex.kind == "slurm" and ex.nodes < 1:
        err.add("executor.nodes", ex.nodes, "must be >= 1")
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
            world = stage_dims(cfg, stage).world_size
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
    bad = False
    for name in ("tp", "pp", "ep", "etp", "cp"):
        if p[name] < 1:
            err.add(f"{key}.{name}", p[name], "must be >= 1")
            bad = True
    if bad:
        return
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
    if card.architecture in HYBRID_ARCHITECTURES and p.tp > 1:
        err.add(f"{key}.tp", p.tp, f"must be 1 for {card.architecture}: ModelOpt 0.47's Nemotron-H import "
                "replicates the Mamba mixer's norm weight, which Megatron shards over TP (the weights "
                "would not load); use ep/pp instead")
    for dim in ("num_attention_heads", "num_query_groups"):
        if card[dim] % p.tp:
            err.add(f"{key}.tp", p.tp, f"must divide model.{dim}={card[dim]} "
                    f"(valid: {', '.join(map(str, divisors(card[dim])))})")
    world = p.world_size or minimal_world_size(p.tp, p.pp, p.cp, p.ep, p.etp)
    dense, expert = p.tp * p.cp * p.pp, p.etp * p.ep * p.pp
    if world % dense:
        err.add(f"{key}.world_size", world, f"must be a multiple of tp*cp*pp = {p.tp}*{p.cp}*{p.pp} = {dense}")
    if world % expert:
        err.add(f"{key}.world_size", world, f"must be a multiple of etp*ep*pp = {p.etp}*{p.ep}*{p.pp} = {expert}")


def _check_rank_grid(cfg: DictConfig, stage: str, err: _Errors) -> None:
    """The stage's ranks can be laid out (what the plan and every rank build: ParallelDims)."""
    key = f"stages.{stage}.parallel"
    if any(line.startswith(key + ".") for line in err.lines):
        return   # already reported, in the config's words
    try:
        stage_dims(cfg, stage)
    except ValueError as e:
        p = cfg.stages[stage].parallel
        err.add(f"{key}.world_size", p.world_size, str(e))


def _check_quantize(cfg: DictConfig, err: _Errors, warnings: list[str], check_paths: bool) -> None:
    q = cfg.stages.quantize
    if not q.enabled:
        return
    c = q.calib
    for key in ("size", "max_seq_len", "batch_size"):
        if c[key] < 1:
            err.add(f"stages.quantize.calib.{key}", c[key], "must be >= 1")
    if q.moe_dispatcher not in schema.DISPATCHERS:
        err.add("stages.quantize.moe_dispatcher", q.moe_dispatcher, f"valid: {', '.join(schema.DISPATCHERS)}")
    if cfg.recipe.format != "none":
        _check_path(c.dataset, "stages.quantize.calib.dataset", err, warnings, check_paths, hub_ok=False)
    _check_calibration_at_ep(cfg, err)


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


def _check_path(value: str, key: str, err: _Errors, warnings: list[str], check_paths: bool, hub_ok: bool) -> None:
    if os.path.exists(value):
        return
    if hub_ok and is_hub_id(value):
        if check_paths and os.environ.get("HF_HUB_OFFLINE") == "1":
            err.add(key, value, "a hub id, but HF_HUB_OFFLINE=1: give a local path")
        return
    if check_paths:
        err.add(key, value, "path does not exist" + ("" if hub_ok else " (a local file or directory is required)"))
    else:
        warnings.append(f"{key}={value!r} not checked (check_paths off)")


def _check_mmlu(cfg: DictConfig, err: _Errors, warnings: list[str], check_paths: bool) -> None:
    m = cfg.stages.mmlu
    if not m.enabled:
        return
    key = "stages.mmlu"
    if not 0 < m.fraction <= 1:
        err.add(f"{key}.fraction", m.fraction, "must satisfy 0 < fraction <= 1")
    if m.lower_bound is not None and not 0 <= m.lower_bound <= 1:
        err.add(f"{key}.lower_bound", m.lower_bound, "must satisfy 0 <= lower_bound <= 1")
    if m.max_drop is not None and not 0 <= m.max_drop <= 1:
        err.add(f"{key}.max_drop", m.max_drop, "must satisfy 0 <= max_drop <= 1")
    if m.baseline not in schema.BASELINE_MODES:
        err.add(f"{key}.baseline", m.baseline, f"valid: {', '.join(schema.BASELINE_MODES)}")
    if m.baseline == "recorded" and m.baseline_accuracy is None:
        err.add(f"{key}.baseline_accuracy", None, "required with baseline=recorded")
    if m.max_drop is not None and m.baseline == "none":
        err.add(f"{key}.max_drop", m.max_drop, "needs a baseline: set stages.mmlu.baseline to recorded, evaluate or cached")
    if m.baseline_accuracy is not None and m.baseline != "recorded":
        err.add(f"{key}.baseline_accuracy", m.baseline_accuracy,
                f"only used with stages.mmlu.baseline=recorded (got baseline={m.baseline!r})")
    _check_gate_rules(m, err)
    if m.baseline == "cached" and check_paths:
        from launcher.mmlu import baseline_cache  # pure Python: reads the cache's JSON entries

        where = baseline_cache.resolve_dir(m.baseline_cache_dir)
        if not baseline_cache.entries_for_model(where, cfg.model.path):
            err.add(f"{key}.baseline", m.baseline,
                    f"no cached baseline for model.path={cfg.model.path} in {where}; run once with "
                    f"stages.mmlu.baseline=evaluate (or set stages.mmlu.baseline_cache_dir)")
    if m.lower_bound is None and m.max_drop is None:
        warnings.append("stages.mmlu has neither lower_bound nor max_drop: the gate always passes")
    for k in ("max_seq_len", "collective_timeout_s"):
        if m[k] < 1:
            err.add(f"{key}.{k}", m[k], "must be >= 1")
    if m.batch_size != "auto" and (isinstance(m.batch_size, bool) or not isinstance(m.batch_size, int)
                                   or m.batch_size < 1):
        err.add(f"{key}.batch_size", m.batch_size, "valid: 'auto' (token budget from the device) or an integer >= 1")
    if m.few_shots < 0:
        err.add(f"{key}.few_shots", m.few_shots, "must be >= 0")
    if m.max_batch_tokens is not None and m.max_batch_tokens < 1:
        err.add(f"{key}.max_batch_tokens", m.max_batch_tokens, "must be >= 1")
    if m.moe_dispatcher not in schema.DISPATCHERS:
        err.add(f"{key}.moe_dispatcher", m.moe_dispatcher, f"valid: {', '.join(schema.DISPATCHERS)}")
    if m.shard_mode not in schema.SHARD_MODES:
        err.add(f"{key}.shard_mode", m.shard_mode, f"valid: {', '.join(schema.SHARD_MODES)}")
    elif m.shard_mode == "dense_dp" and m.parallel.ep > 1 and not m.allow_unsafe_shard_mode:
        err.add(f"{key}.shard_mode", m.shard_mode,
                f"shards batches over the dense data-parallel group, which desyncs the expert all-to-all at "
                f"ep={m.parallel.ep} (the seed bug); use auto, balanced or lockstep")
    _check_path(m.dataset, f"{key}.dataset", err, warnings, check_paths, hub_ok=True)
    if m.dev_dataset:
        _check_path(m.dev_dataset, f"{key}.dev_dataset", err, warnings, check_paths, hub_ok=True)
    if check_paths:
        from launcher.mmlu.data import MmluDataError, check_source  # pure Python: layout of the source

        for field_name in ("dataset", "dev_dataset"):
            value = m[field_name]
            if value and os.path.exists(value):
                try:
                    check_source(value, f"{key}.{field_name}")
                except MmluDataError as e:
                    err.add(f"{key}.{field_name}", value, str(e).replace(f"{key}.{field_name}={value!r}: ", ""))
    elif m.few_shots and m.dataset.endswith(".jsonl"):
        err.add(f"{key}.few_shots", m.few_shots, "a jsonl dataset has no dev split: set stages.mmlu.dev_dataset")
    if not cfg.stages.quantize.enabled and cfg.recipe.format != "none":
        warnings.append("stages.mmlu evaluates the unquantized checkpoint: stages.quantize is disabled")


def _check_gate_rules(m: DictConfig, err: _Errors) -> None:
    """The gate's own checker (what the mmlu stage runs first on every rank), unless the lines
    above already named one of its keys: a rule of the gate can never pass here and fail there."""
    from launcher.mmlu.gate import check_gate_config  # pure Python

    keys = ("lower_bound", "max_drop", "baseline", "baseline_accuracy")
    if any(line.startswith(tuple(f"stages.mmlu.{k}=" for k in keys)) for line in err.lines):
        return
    try:
        check_gate_config(m.lower_bound, m.max_drop, m.baseline, m.baseline_accuracy)
    except ValueError as e:   # its messages name the key and the valid values already
        err.lines.append(str(e))


def _check_export(cfg: DictConfig, err: _Errors) -> None:
    e = cfg.stages.export
    if not e.enabled:
        return
    why = "ModelOpt's Megatron->HF export silently corrupts at tp>1 (empty tensors) and ep>1 (drops experts)"
    if e.parallel.tp != 1:
        err.add("stages.export.parallel.tp", e.parallel.tp, f"must be 1: {why}; use pp to spread the model")
    if e.parallel.ep != 1:
        err.add("stages.export.parallel.ep", e.parallel.ep, f"must be 1: {why}; use pp to spread the model")
    if e.parallel.etp != 1:
        err.add("stages.export.parallel.etp", e.parallel.etp, f"must be 1: {why}; use pp to spread the model")
    if not re.match(r"^[\w.-]+$", e.name):
        err.add("stages.export.name", e.name, "must be a plain directory name")
    if not cfg.stages.quantize.enabled and cfg.recipe.format != "none":
        err.add("stages.export.enabled", True,
                f"exporting recipe {cfg.recipe.name!r} needs stages.quantize's checkpoint; enable stages.quantize "
                "or use recipe=none")


def _check_vllm_tensor_parallel(cfg: DictConfig, err: _Errors) -> None:
    """vLLM splits attention heads over its tensor-parallel workers (KV heads replicate), all on the
    one node that runs the stage's rank."""
    tp, heads = cfg.stages.vllm_smoke.tensor_parallel_size, cfg.model.num_attention_heads
    key = "stages.vllm_smoke.tensor_parallel_size"
    if tp < 1:
        err.add(key, tp, "must be >= 1")
        return
    if heads % tp:
        err.add(key, tp, f"must divide model.num_attention_heads={heads} "
                         f"(valid: {', '.join(map(str, divisors(heads)))})")
    gpus = cfg.executor.gpus_per_node if cfg.executor.kind == "slurm" else 0
    if gpus and tp > gpus:
        err.add(key, tp, f"vLLM's workers share one node, which has executor.gpus_per_node={gpus}")


def _check_vllm(cfg: DictConfig, err: _Errors, warnings: list[str], check_paths: bool) -> None:
    v = cfg.stages.vllm_smoke
    key = "stages.vllm_smoke"
    if not v.enabled:
        return
    if v.mode not in schema.VLLM_MODES:
        err.add(f"{key}.mode", v.mode, f"valid: {', '.join(schema.VLLM_MODES)}")
    if v.on_unsupported not in schema.ON_UNSUPPORTED:
        err.add(f"{key}.on_unsupported", v.on_unsupported, f"valid: {', '.join(schema.ON_UNSUPPORTED)}")
    if v.scoring not in schema.VLLM_SCORING:
        err.add(f"{key}.scoring", v.scoring, f"valid: {', '.join(schema.VLLM_SCORING)}")
    for name in ("min_accuracy", "min_agreement"):
        if v[name] is not None and not 0 <= v[name] <= 1:
            err.add(f"{key}.{name}", v[name], f"must be null or satisfy 0 <= {name} <= 1")
    if v.tie_margin < 0:
        err.add(f"{key}.tie_margin", v.tie_margin, "must be >= 0 (a logit margin; 0 counts every question)")
    if v.questions < 0:
        err.add(f"{key}.questions", v.questions, "must be >= 0 (0: every question the gate evaluated)")
    if v.max_tokens < 1:
        err.add(f"{key}.max_tokens", v.max_tokens, "must be >= 1")
    if v.score_choices and not cfg.stages.mmlu.enabled:
        err.add(f"{key}.score_choices", True,
                "compares vLLM with the gate's mmlu/results.json: enable stages.mmlu, or set "
                "stages.vllm_smoke.score_choices=false (generation checks only)")
    if not v.score_choices and not v.prompts:
        err.add(f"{key}.prompts", v.prompts,
                "nothing to check with score_choices=false: give a jsonl of generation checks")
    if v.prompts:
        _check_path(str(v.prompts), f"{key}.prompts", err, warnings, check_paths, hub_ok=False)
    _check_vllm_tensor_parallel(cfg, err)
    if not cfg.stages.export.enabled and not v.model_dir:
        err.add("stages.vllm_smoke.enabled", True,
                "serves stages.export's checkpoint: enable stages.export or set stages.vllm_smoke.model_dir")
