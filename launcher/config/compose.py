"""Compose a pipeline config from any example file path plus Hydra overrides.

The example file is the primary config; its defaults list picks the schema (`ptq_schema`) and
one option of each group: `model` and `executor` (YAML under launcher/conf/) and `recipe`
(YAML under the repository's recipes/).  Group options are stored in Hydra's ConfigStore,
typed by their dataclass, so a wrong key in any of them is an error.
"""
from __future__ import annotations

import os
import re
from typing import Sequence

from omegaconf import DictConfig, OmegaConf

from launcher import formats
from launcher import schema
from launcher.contract import UserError
from launcher.config.hf_card import card_from_hf_config
from launcher.hf_config import read_hf_config_if_present
from launcher.paths import PACKAGE_DIR, RECIPES_DIR, REPO_ROOT, cache_dir, recipe_names, yaml_options

CONF_DIR = os.path.join(PACKAGE_DIR, "conf")

GROUP_SCHEMAS = {
    "model": schema.ModelCard,
    "recipe": schema.RecipeConfig,
}
EXECUTOR_SCHEMAS = {"local": schema.LocalExecutorConfig, "slurm": schema.SlurmExecutorConfig}


class ConfigError(UserError):
    """A user error in a config: names the key, the value and what would be valid."""


def _register_resolvers() -> None:
    if not OmegaConf.has_resolver("ptq_cache"):
        OmegaConf.register_new_resolver("ptq_cache", cache_dir)
    if not OmegaConf.has_resolver("repo_root"):
        OmegaConf.register_new_resolver("repo_root", lambda: REPO_ROOT)


def register_configs() -> None:
    """Store the schema and every group option in Hydra's ConfigStore (idempotent)."""
    from hydra.core.config_store import ConfigStore

    _register_resolvers()
    cs = ConfigStore.instance()
    cs.store(name="ptq_schema", node=schema.PipelineConfig)
    for group, directory in (("model", os.path.join(CONF_DIR, "model")), ("recipe", RECIPES_DIR)):
        for name, path in yaml_options(directory).items():
            node = OmegaConf.merge(OmegaConf.structured(GROUP_SCHEMAS[group]), _load_yaml(path, group, name))
            cs.store(group=group, name=name, node=node)
    for name, path in yaml_options(os.path.join(CONF_DIR, "executor")).items():
        raw = _load_yaml(path, "executor", name)
        kind = raw.get("kind", name)
        if kind not in EXECUTOR_SCHEMAS:
            raise ConfigError(f"executor/{name}.yaml: kind={kind!r} is not one of {sorted(EXECUTOR_SCHEMAS)}")
        cs.store(group="executor", name=name,
                 node=OmegaConf.merge(OmegaConf.structured(EXECUTOR_SCHEMAS[kind]), raw))


def _load_yaml(path: str, group: str, name: str) -> DictConfig:
    try:
        return OmegaConf.load(path)
    except Exception as e:  # noqa: BLE001 - re-raised with the file named
        raise ConfigError(f"{group}/{name}: cannot parse {path}: {e}") from e


def compose_example(path: str, overrides: Sequence[str] = ()) -> DictConfig:
    """Compose `path` (an example YAML anywhere on disk) with Hydra overrides; resolve it.

    Returns a resolved, struct-mode DictConfig whose model card is completed from the
    checkpoint's config.json when the card says `from_checkpoint: true`.
    """
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    if not os.path.isfile(path):
        raise ConfigError(f"config file {path!r} does not exist")
    if not path.endswith((".yaml", ".yml")):
        raise ConfigError(f"config file {path!r} is not a .yaml file")
    register_configs()
    config_dir = os.path.dirname(os.path.abspath(path))
    name = os.path.splitext(os.path.basename(path))[0]
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(version_base="1.3", config_dir=config_dir, job_name="launch"):
            cfg = compose(config_name=name, overrides=list(overrides))
    except (HydraException, OmegaConfBaseException) as e:
        raise ConfigError(_explain_hydra_error(e)) from e
    finally:
        GlobalHydra.instance().clear()
    try:
        OmegaConf.resolve(cfg)
    except OmegaConfBaseException as e:
        raise ConfigError(f"cannot resolve {path}: {e}") from e
    _check_against_schema(cfg)
    _complete_model_card(cfg)
    return cfg


def _check_against_schema(cfg: DictConfig) -> None:
    """Re-merge onto the dataclasses: catches keys added with '+key=...' overrides too."""
    typed_config(OmegaConf.to_container(cfg, resolve=True))


def typed_config(data: dict) -> DictConfig:
    """A resolved config's plain mapping (the run directory's config.yaml) as the schema's typed
    config: PipelineConfig with the executor merged onto its kind's dataclass, Enum fields as
    Enums, every key the schema has present.  ConfigError names an unknown or invalid key."""
    from omegaconf.errors import OmegaConfBaseException

    data = dict(data)
    executor = data.pop("executor", None) or {}
    try:
        cfg = OmegaConf.merge(OmegaConf.structured(schema.PipelineConfig), data)
    except OmegaConfBaseException as e:
        raise ConfigError(_unknown_key_message(e.full_key) if "not in" in str(e) else str(e)) from e
    kind = executor.get("kind")
    if kind not in EXECUTOR_SCHEMAS:
        raise ConfigError(f"executor.kind={kind!r}: valid: {', '.join(sorted(EXECUTOR_SCHEMAS))}")
    try:
        cfg.executor = OmegaConf.merge(OmegaConf.structured(EXECUTOR_SCHEMAS[kind]), executor)
    except OmegaConfBaseException as e:
        valid = ", ".join(sorted(OmegaConf.structured(EXECUTOR_SCHEMAS[kind]).keys()))
        raise ConfigError(f"unknown or invalid key 'executor.{e.key}' for executor kind {kind!r}; valid keys: {valid}") from e
    return cfg


def load_run_config(path: str) -> DictConfig:
    """config.yaml of a run directory, typed (``typed_config``): what every stage rank reads."""
    return typed_config(OmegaConf.to_container(OmegaConf.load(path), resolve=True))


def _explain_hydra_error(e: Exception) -> str:
    msg = str(e).split("\nConfig search path:")[0].strip()
    unknown = (re.search(r"Could not override '([\w.]+)'", msg) or re.search(r"Key '(\w+)' is not in struct", msg)
               or re.search(r"Key '\w+' not in '\w+'\s+full_key: ([\w.]+)", msg))   # a YAML key the schema lacks
    if unknown:
        return _unknown_key_message(unknown.group(1))
    cause = e.__cause__ or e.__context__
    choice = re.match(r"Error merging override ([\w.]+)=", msg)
    bad = re.match(r"Invalid value '(.*)', expected one of \[(.*)\]", str(cause or "").splitlines()[0] if cause else "")
    if choice and bad:   # an Enum field of the schema: the key, the value and the valid ones
        key, value = choice.group(1), bad.group(1)
        if key == "recipe.format":
            return f"{key}={value!r}: {formats.format_problem(value)}"
        return f"{key}={value!r}: valid: {bad.group(2)}"
    if "Error merging override" in msg and cause is not None:
        return f"{msg}: {str(cause).splitlines()[0]}"
    if "Could not find 'recipe/" in msg:
        return f"{msg}\n(key: recipe; valid recipes: {', '.join(recipe_names())})"
    return msg


ENV_HOWTO = ("env holds variables for every rank: add one with `+env.NAME=value` (Hydra's `+` adds a key), "
             "or in the example's YAML under env:. A secret (a name with TOKEN, SECRET, PASSWORD, API_KEY, "
             "ACCESS_KEY, PRIVATE_KEY or CREDENTIAL) is masked in config.yaml and never written to an sbatch "
             "script; to keep it off the command line too, export it in the shell that runs `launch` "
             "(e.g. `export HF_TOKEN=...`): every rank inherits launch's environment")


# keys that were renamed: what the unknown-key message says to use instead
MOVED_KEYS = {
    "stages.vllm_smoke.parallel": "vLLM's tensor parallelism is stages.vllm_smoke.tensor_parallel_size; "
                                  "the stage runs one launcher rank",
}


def _unknown_key_message(dotted: str) -> str:
    """'stages.mmlu.bogus' -> which key is unknown and the valid keys at that level."""
    if dotted == "env" or dotted.startswith("env."):
        return f"cannot set {dotted!r} this way: {ENV_HOWTO}"
    node = OmegaConf.structured(schema.PipelineConfig)
    parts = dotted.split(".")
    for i, part in enumerate(parts[:-1]):
        child = node.get(part) if isinstance(node, DictConfig) else None
        if not isinstance(child, DictConfig):
            break
        node = child
    valid = sorted(node.keys()) if isinstance(node, DictConfig) else []
    hint = next((h for k, h in MOVED_KEYS.items() if dotted == k or dotted.startswith(k + ".")), "")
    return f"unknown key {dotted!r}; valid keys here: {', '.join(valid)}" + (f" ({hint})" if hint else "")


def _complete_model_card(cfg: DictConfig) -> None:
    """`model=from_checkpoint model.path=DIR`: fill every missing card field from DIR/config.json."""
    card = cfg.model
    if not card.from_checkpoint:
        return
    path = card.path if not OmegaConf.is_missing(card, "path") else None
    if not path:
        raise ConfigError("model.path is required with model=from_checkpoint (a local HF checkpoint directory)")
    try:
        hf = read_hf_config_if_present(path)
        if hf is None:
            raise ConfigError(f"model.path={path!r}: no config.json there; model=from_checkpoint needs a "
                              "local checkpoint")
        derived = card_from_hf_config(hf)
    except ConfigError:
        raise
    except ValueError as e:
        raise ConfigError(f"model.path={path!r}: {e}") from e
    defaults = schema.ModelCard()
    for key, value in derived.items():
        # config.json fills every field left missing or at its schema default
        if OmegaConf.is_missing(card, key) or card[key] is None or card[key] == getattr(defaults, key):
            card[key] = value
    if OmegaConf.is_missing(card, "name"):
        card.name = os.path.basename(os.path.normpath(path))
