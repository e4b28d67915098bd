"""RecipeConfig -> ModelOpt quantization config (a dict ``mtq.quantize`` accepts), or None.

A recipe names either an attribute of ``modelopt.torch.quantization`` (``modelopt_cfg``, e.g.
NVFP4_DEFAULT_CFG) or a ModelOpt recipe YAML (``recipe_path``: a file path, or a path inside
ModelOpt's built-in recipe library such as ``general/ptq/nvfp4_mlp_weight_only``).  Format
``none`` means no quantization.  ``exclude_modules`` (module-name wildcards) become
``enable: false`` entries appended after the recipe's own entries, so they win.
"""
from __future__ import annotations

import copy
import os
from typing import TYPE_CHECKING, Any

from launcher.contract import UserError
from launcher.formats import CARRIED as FORMATS, format_problem   # the one format table

if TYPE_CHECKING:   # the dataclass, or a DictConfig merged onto it (the composed config's recipe)
    from launcher.schema import RecipeConfig


def validate_recipe(recipe: RecipeConfig) -> None:
    """Structural checks that need no torch (validation calls this; so does the quantize stage)."""
    name, fmt, cfg_name, path = recipe.name, recipe.format, recipe.modelopt_cfg, recipe.recipe_path
    problem = format_problem(fmt)
    if problem:
        raise UserError(f"recipe.format={fmt!r}: {problem}")
    if fmt == "none":
        if cfg_name or path:
            raise UserError(f"recipe.format='none' quantizes nothing: recipe.modelopt_cfg and recipe.recipe_path "
                            f"must be null (got modelopt_cfg={cfg_name!r}, recipe_path={path!r})")
        return
    if bool(cfg_name) == bool(path):
        raise UserError(f"recipe {name!r}: set exactly one of recipe.modelopt_cfg and recipe.recipe_path "
                        f"(got modelopt_cfg={cfg_name!r}, recipe_path={path!r})")
    for pattern in recipe.exclude_modules:
        if not isinstance(pattern, str) or not pattern:
            raise UserError(f"recipe.exclude_modules: entries must be non-empty strings, got {pattern!r}")


def named_modelopt_configs() -> list[str]:
    import modelopt.torch.quantization as mtq

    return sorted(n for n in dir(mtq) if n.endswith("_CFG") and isinstance(getattr(mtq, n), dict))


def _load_named(name: str) -> dict[str, Any]:
    import modelopt.torch.quantization as mtq

    value = getattr(mtq, name, None)
    if not isinstance(value, dict):
        raise UserError(f"recipe modelopt_cfg={name!r} is not a ModelOpt quantization config; "
                         f"valid values: {named_modelopt_configs()}")
    return copy.deepcopy(value)


def _load_recipe_yaml(path: str) -> dict[str, Any]:
    from modelopt.recipe.loader import load_recipe

    try:
        loaded = load_recipe(path)
    except (FileNotFoundError, ValueError) as e:
        raise UserError(f"recipe_path={path!r} cannot be loaded as a ModelOpt recipe: {e}") from e
    quantize = getattr(loaded, "quantize", None)
    if quantize is None:
        raise UserError(f"recipe_path={path!r} is not a PTQ recipe (no 'quantize' section)")
    return quantize.model_dump() if hasattr(quantize, "model_dump") else dict(quantize)


def exclusion_entries(patterns: list[str]) -> list[dict[str, Any]]:
    """quant_cfg entries disabling every quantizer of modules matching the wildcard patterns."""
    entries = []
    for pattern in patterns:
        entries.append({"quantizer_name": pattern, "enable": False})
        if not pattern.endswith("*"):
            entries.append({"quantizer_name": f"{pattern}.*", "enable": False})
    return entries


def resolve_quant_cfg(recipe: RecipeConfig, base_dir: str | None = None) -> dict[str, Any] | None:
    """The ModelOpt config for ``recipe`` (None for format 'none'). Raises ValueError when invalid."""
    validate_recipe(recipe)
    if recipe.format == "none":
        return None
    cfg_name, path = recipe.modelopt_cfg, recipe.recipe_path
    if cfg_name:
        cfg = _load_named(cfg_name)
    else:
        if base_dir and not os.path.isabs(path) and os.path.exists(os.path.join(base_dir, path)):
            path = os.path.join(base_dir, path)
        cfg = _load_recipe_yaml(path)
    excludes = list(recipe.exclude_modules)
    if excludes:
        quant_cfg = cfg.get("quant_cfg")
        if isinstance(quant_cfg, list):
            cfg["quant_cfg"] = list(quant_cfg) + exclusion_entries(excludes)
        elif isinstance(quant_cfg, dict):  # older ModelOpt layout: {pattern: cfg}
            cfg["quant_cfg"] = {**quant_cfg, **{e["quantizer_name"]: {"enable": False}
                                                for e in exclusion_entries(excludes)}}
        else:
            raise UserError(f"recipe {recipe.name!r}: its ModelOpt config has no quant_cfg to "
                             "apply exclude_modules to")
    return cfg


# Calibration algorithms whose ModelOpt 0.47 implementation desyncs expert-parallel ranks: awq
# issues one data-parallel collective per linear whose local token count was > 0, so at EP>1 an
# expert that received no tokens on one rank changes the collective sequence (gloo aborts with
# "Received data size doesn't match expected size"; NCCL would hang).  Measured on CPU/gloo with
# NVFP4_AWQ_LITE_CFG at EP4; the same recipe works at EP1 (any DP).
EP_UNSAFE_ALGORITHMS = ("awq_lite", "awq_full", "awq_clip")


def check_recipe_layout(cfg: dict[str, Any] | None, ep: int, recipe_name: str = "") -> None:
    """ValueError when the recipe's calibration cannot run at this expert-parallel degree."""
    algorithm = calibration_algorithm(cfg)
    if ep > 1 and algorithm in EP_UNSAFE_ALGORITHMS:
        raise UserError(
            f"recipe {recipe_name!r} calibrates with {algorithm!r}, which desyncs expert-parallel ranks "
            f"in ModelOpt's implementation (collectives depend on per-rank expert token counts); "
            f"run the quantize stage with ep=1 (stages.quantize.parallel.ep=1) or use a max-calibrated "
            f"recipe; got ep={ep}")


def calibration_algorithm(cfg: dict[str, Any] | None) -> str | None:
    if cfg is None:
        return None
    algo = cfg.get("algorithm", "max")
    if isinstance(algo, dict):
        return algo.get("method", str(algo))
    return str(algo) if algo is not None else None


def declared_algorithm(recipe: RecipeConfig) -> tuple[bool, str | None]:
    """The recipe's calibration algorithm read from YAML alone (no torch): (known, algorithm).

    A named ModelOpt config (``NVFP4_AWQ_LITE_CFG``) is read from the preset ModelOpt ships for it
    (modelopt_recipes/configs/ptq/presets/model/nvfp4_awq_lite.yaml); a recipe YAML from its
    ``quantize`` section, following one ``$import``.  ``known`` is False when neither can be read:
    the quantize stage then decides with the resolved config (check_recipe_layout)."""
    if recipe.format == "none":
        return True, None
    cfg_name, path = recipe.modelopt_cfg, recipe.recipe_path
    if cfg_name:
        section = _recipes_yaml(f"configs/ptq/presets/model/{str(cfg_name).lower().removesuffix('_cfg')}")
    else:
        doc = _yaml_file(path) if path and os.path.isfile(path) else _recipes_yaml(path or "")
        section = doc.get("quantize") if isinstance(doc, dict) else None
        if isinstance(section, dict) and "$import" in section:
            section = _recipes_yaml(str((doc.get("imports") or {}).get(section["$import"], "")))
    if not isinstance(section, dict):
        return False, None
    return True, calibration_algorithm({"algorithm": section.get("algorithm", "max")})


def _recipes_yaml(name: str):
    """A YAML of ModelOpt's modelopt_recipes package (found, not imported), or None."""
    from launcher.quant.recipe_yaml import builtin_recipe

    found = builtin_recipe(name)
    return _yaml_file(found) if found else None


def _yaml_file(path: str):
    import yaml

    with open(path) as f:
        return yaml.safe_load(f)
