"""A ModelOpt PTQ recipe YAML (``recipe.recipe_path``) checked without ModelOpt or torch.

What the quantize stage's ``modelopt.recipe.load_recipe`` takes, read with PyYAML alone:

    imports:  {name: path of a ModelOpt config snippet}        (optional)
    metadata: {recipe_type: ptq, description: ...}             (required)
    quantize: {algorithm: ..., quant_cfg: [...], effective_bits: ...}  or  {$import: name}

``quant_cfg`` is a list whose entries are ``{$import: name}`` or ``{quantizer_name: '<wildcard>',
parent_class?, cfg?, enable?}`` (or the older mapping ``{'<wildcard>': {...}}``).  A recipe path
that is not a file is looked up among ModelOpt's built-in recipes (``modelopt_recipes``, found on
disk, not imported); those are ModelOpt's own and are not re-checked here.
"""
from __future__ import annotations

import functools
import importlib.util
import os
import re
from typing import Any, Optional

TOP_KEYS = ("imports", "metadata", "quantize")
QUANTIZE_KEYS = ("algorithm", "quant_cfg", "effective_bits")
ENTRY_KEYS = ("quantizer_name", "parent_class", "cfg", "enable")
RECIPE_TYPE = "ptq"


def builtin_recipe(name: str) -> Optional[str]:
    """The file of ModelOpt's built-in recipe ``name`` (e.g. general/ptq/nvfp4_mlp_weight_only), or None."""
    spec = importlib.util.find_spec("modelopt_recipes")
    for root in list(spec.submodule_search_locations or []) if spec is not None else []:
        for suffix in ("", ".yaml", ".yml"):
            if name and os.path.isfile(os.path.join(root, name + suffix)):
                return os.path.join(root, name + suffix)
    return None


@functools.lru_cache(maxsize=1)
def modelopt_config_names() -> Optional[tuple[str, ...]]:
    """The ``*_CFG`` configs ``modelopt.torch.quantization`` defines, read from its config module's
    source (importing it imports torch); None where ModelOpt is not installed (a login node)."""
    spec = importlib.util.find_spec("modelopt")
    roots = list(spec.submodule_search_locations or []) if spec is not None else []
    for root in roots:
        source = os.path.join(root, "torch", "quantization", "config.py")
        if os.path.isfile(source):
            with open(source, encoding="utf-8") as f:
                return tuple(sorted(set(re.findall(r"^([A-Z][A-Z0-9_]*_CFG)\b\s*[:=]", f.read(), re.MULTILINE))))
    return None


def check_modelopt_cfg(name: str, key: str = "recipe.modelopt_cfg") -> list[str]:
    names = modelopt_config_names()
    if names is None or name in names:
        return []
    return [f"{key}={name!r}: not a ModelOpt quantization config; valid: {', '.join(names)}"]


def check_recipe_file(recipe_path: str, key: str = "recipe.recipe_path") -> list[str]:
    """One line per problem of the recipe YAML, each naming ``key``, the file and what is valid."""
    head = f"{key}={recipe_path!r}"
    if not os.path.isfile(recipe_path):
        if builtin_recipe(recipe_path) is not None:
            return []
        return [f"{head}: neither a file nor a ModelOpt built-in recipe (modelopt_recipes/<name>.yaml, "
                "e.g. general/ptq/nvfp4_mlp_weight_only)"]
    import yaml

    try:
        with open(recipe_path, encoding="utf-8") as f:
            doc = yaml.safe_load(f)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{recipe_path}:{mark.line + 1}" if mark is not None else recipe_path
        what = " ".join(str(getattr(e, "problem", None) or e).split())
        return [f"{head}: {where}: not YAML: {what}"]
    except (OSError, UnicodeDecodeError) as e:
        return [f"{head}: cannot be read: {e}"]
    return [f"{head}: {p}" for p in recipe_problems(doc)]


def recipe_problems(doc: Any) -> list[str]:
    """What ``load_recipe`` would refuse in a parsed PTQ recipe (empty: the shape is right)."""
    if not isinstance(doc, dict):
        return [f"the file holds a {type(doc).__name__}; valid: a mapping with keys {', '.join(TOP_KEYS)}"]
    out = [f"unknown key {k!r}; valid keys: {', '.join(TOP_KEYS)}" for k in doc if k not in TOP_KEYS]
    imports = doc.get("imports") or {}
    if not isinstance(imports, dict) or not all(isinstance(v, str) for v in imports.values()):
        out.append(f"imports={imports!r}; valid: a mapping of names to ModelOpt config paths")
        imports = {}
    meta = doc.get("metadata")
    if not isinstance(meta, dict) or meta.get("recipe_type") != RECIPE_TYPE:
        found = meta.get("recipe_type") if isinstance(meta, dict) else meta
        out.append(f"metadata.recipe_type={found!r}; valid: {RECIPE_TYPE!r} (this launcher runs PTQ recipes)")
    if "quantize" not in doc:
        return out + ["no 'quantize' section; valid: quantize: {algorithm, quant_cfg}"]
    return out + _quantize_problems(doc["quantize"], imports)


def _import_problem(where: str, name: Any, imports: dict) -> list[str]:
    if name in imports:
        return []
    return [f"{where}: $import {name!r} is not in imports (valid: {', '.join(map(str, imports)) or 'none declared'})"]


def _quantize_problems(section: Any, imports: dict) -> list[str]:
    if isinstance(section, dict) and set(section) == {"$import"}:
        return _import_problem("quantize", section["$import"], imports)
    if not isinstance(section, dict):
        return [f"quantize is a {type(section).__name__}; valid: a mapping with {', '.join(QUANTIZE_KEYS)}"]
    out = [f"quantize.{k}: unknown key; valid keys: {', '.join(QUANTIZE_KEYS)}" for k in section
           if k not in QUANTIZE_KEYS]
    algo = section.get("algorithm", "max")
    if not (algo is None or isinstance(algo, str) or (isinstance(algo, dict) and isinstance(algo.get("method"), str))):
        out.append(f"quantize.algorithm={algo!r}; valid: a name (max, awq_lite, ...), null, or {{method: name, ...}}")
    quant_cfg = section.get("quant_cfg", [])
    if isinstance(quant_cfg, dict):   # the older layout: {wildcard: attributes}
        return out + [f"quantize.quant_cfg[{k!r}]={v!r}; valid: a mapping of quantizer attributes"
                      for k, v in quant_cfg.items() if not isinstance(v, (dict, list))]
    if not isinstance(quant_cfg, list):
        return out + [f"quantize.quant_cfg is a {type(quant_cfg).__name__}; valid: a list of "
                      "{quantizer_name, cfg, enable} entries"]
    for i, entry in enumerate(quant_cfg):
        out += _entry_problems(f"quantize.quant_cfg[{i}]", entry, imports)
    return out


def _entry_problems(where: str, entry: Any, imports: dict) -> list[str]:
    if isinstance(entry, dict) and set(entry) == {"$import"}:
        return _import_problem(where, entry["$import"], imports)
    if not isinstance(entry, dict):
        return [f"{where}={entry!r}; valid: {{quantizer_name: '<wildcard>', cfg: {{...}}, enable: bool}} "
                "or {$import: name}"]
    out = [f"{where}.{k}: unknown key; valid keys: {', '.join(ENTRY_KEYS)}" for k in entry if k not in ENTRY_KEYS]
    if not isinstance(entry.get("quantizer_name"), str) or not entry.get("quantizer_name"):
        out.append(f"{where}.quantizer_name={entry.get('quantizer_name')!r}; valid: a wildcard string, "
                   "e.g. '*weight_quantizer'")
    if "enable" in entry and not isinstance(entry["enable"], bool):
        out.append(f"{where}.enable={entry['enable']!r}; valid: true or false")
    cfg = entry.get("cfg")
    if cfg is not None and not isinstance(cfg, (dict, list)):
        out.append(f"{where}.cfg={cfg!r}; valid: a mapping of quantizer attributes (num_bits, axis, ...), "
                   "a list of them, or {$import: name}")
    elif isinstance(cfg, dict) and set(cfg) == {"$import"}:
        out += _import_problem(f"{where}.cfg", cfg["$import"], imports)
    return out
