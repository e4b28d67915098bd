"""What each key of the schema accepts, stated beside its field and checked by one walker.

A schema field carries its rule in the dataclass field's ``metadata["rule"]`` (``ranged``,
``path``, ``pattern``, ``text`` build such fields):

* ``Range``   numbers: bounds, open or closed (ports 1-65535, timeouts > 0, counts >= 1);
* ``Path``    paths: file or directory, must exist or will be created, a hub id allowed or not;
* ``Pattern`` strings with a syntax (a job name, a directory name);
* ``Text``    free-form strings (a description, a partition name): anything is valid;
* ``Owned``   a key whose rule is a library's own checker (the gate's bounds, Slurm's time
  syntax, the recipe's keys): validation calls that checker, so the rule is stated once.

Choice keys are Enums (``launcher.contract``): OmegaConf refuses any other value when the config
is composed, so no rule here restates them.  ``problems(cfg, check_paths)`` walks the composed
config (each node's dataclass from ``OmegaConf.get_type``) and returns ``(key, value, problem)``
for every value its rule refuses; path rules of a disabled stage are not checked.  No torch.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import re
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from omegaconf import MISSING, DictConfig, OmegaConf

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def is_hub_id(value: str) -> bool:
    """'org/name' that is not a path on this machine."""
    return bool(_HUB_ID.match(value)) and not os.path.exists(value) and not value.startswith((".", "/"))


def _num(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else str(v)


@dataclass(frozen=True)
class Range:
    lo: Optional[float] = None
    hi: Optional[float] = None
    lo_open: bool = False
    note: str = ""            # what the bound means, e.g. "0: every question the gate evaluated"

    def holds(self, v: float) -> bool:
        above = self.lo is None or (v > self.lo if self.lo_open else v >= self.lo)
        return above and (self.hi is None or v <= self.hi)

    def describe(self, name: str, optional: bool) -> str:
        lo_op = "<" if self.lo_open else "<="
        if self.lo is not None and self.hi is not None:
            text = f"satisfy {_num(self.lo)} {lo_op} {name} <= {_num(self.hi)}"
        elif self.lo is not None:
            text = f"be {'>' if self.lo_open else '>='} {_num(self.lo)}"
        else:
            text = f"be <= {_num(self.hi)}"
        return ("must be null or " + text.removeprefix("be ") if optional else "must " + text) + \
            (f" ({self.note})" if self.note else "")

    def problem(self, name: str, value: Any, optional: bool, cfg: DictConfig, check_paths: bool) -> Optional[str]:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or self.holds(value):
            return None   # a non-number is the key's own rule (e.g. batch_size 'auto')
        return self.describe(name, optional)

    def invalid(self) -> list[float]:
        """Values just outside the range (for tests)."""
        out = []
        if self.lo is not None:
            out.append(self.lo if self.lo_open else self.lo - 1)
        if self.hi is not None:
            out.append(self.hi + 1)
        return out


@dataclass(frozen=True)
class Path:
    kind: str = "any"         # file | dir | any
    exists: bool = True       # False: created when missing (then it must not be another kind)
    hub_ok: bool = False      # a Hugging Face hub id is valid too
    when: Optional[Callable[[DictConfig], bool]] = None   # checked only when this holds

    def _kind_word(self) -> str:
        return {"file": "a file", "dir": "a directory", "any": "a file or directory"}[self.kind]

    def problem(self, name: str, value: Any, optional: bool, cfg: DictConfig, check_paths: bool) -> Optional[str]:
        if not check_paths or (self.when is not None and not self.when(cfg)):
            return None
        path = os.path.expanduser(str(value))
        if self.hub_ok and is_hub_id(path):
            if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() not in ("", "0", "false", "no"):
                return "a hub id, but HF_HUB_OFFLINE=1: give a local path"
            return None
        if os.path.exists(path):
            if self.kind == "file" and not os.path.isfile(path):
                return "is a directory; valid: a file"
            if self.kind == "dir" and not os.path.isdir(path):
                return "is a file; valid: a directory" + ("" if self.exists else " (created when missing)")
            return None
        if self.exists:
            return f"path does not exist; valid: an existing {self._kind_word().removeprefix('a ')}" + \
                (" or a hub id (org/name)" if self.hub_ok else "")
        parent = os.path.dirname(os.path.abspath(path))
        while not os.path.exists(parent):
            parent = os.path.dirname(parent)
        if not os.path.isdir(parent):
            return f"cannot be created: {parent} is a file"
        if not os.access(parent, os.W_OK | os.X_OK):
            return f"cannot be created: {parent} is not writable"
        return None


@dataclass(frozen=True)
class Pattern:
    regex: str
    hint: str                 # what is valid, in words

    def problem(self, name: str, value: Any, optional: bool, cfg: DictConfig, check_paths: bool) -> Optional[str]:
        return None if re.fullmatch(self.regex, str(value)) else self.hint


@dataclass(frozen=True)
class Text:
    """Any string is valid (a description, a partition name, an interpreter on another machine)."""

    def problem(self, *_args) -> Optional[str]:
        return None


@dataclass(frozen=True)
class Owned:
    """The key's rule is ``owner``'s (validation calls it); nothing is restated here."""

    owner: str

    def problem(self, *_args) -> Optional[str]:
        return None


RULES = (Range, Path, Pattern, Text, Owned)


def ranged(default: Any = MISSING, lo: Optional[float] = None, hi: Optional[float] = None, *,
           lo_open: bool = False, note: str = "") -> Any:
    return field(default=default, metadata={"rule": Range(lo, hi, lo_open, note)})


def path(default: Any = MISSING, kind: str = "any", *, exists: bool = True, hub_ok: bool = False,
         when: Optional[Callable[[DictConfig], bool]] = None) -> Any:
    return field(default=default, metadata={"rule": Path(kind, exists, hub_ok, when)})


def pattern(default: Any, regex: str, hint: str) -> Any:
    return field(default=default, metadata={"rule": Pattern(regex, hint)})


def text(default: Any = MISSING) -> Any:
    return field(default=default, metadata={"rule": Text()})


def owned(owner: str, default: Any = MISSING) -> Any:
    return field(default=default, metadata={"rule": Owned(owner)})


def rule_of(f: dataclasses.Field) -> Any:
    return f.metadata.get("rule")


def problems(cfg: DictConfig, check_paths: bool) -> list[tuple[str, Any, str]]:
    """(key, value, problem) for every value of ``cfg`` its field's rule refuses."""
    out: list[tuple[str, Any, str]] = []
    data = OmegaConf.to_container(cfg, resolve=True)   # one conversion: the walk reads plain values
    _walk(data, OmegaConf.get_type(cfg), "", cfg, check_paths, out, {"executor": OmegaConf.get_type(cfg.executor)})
    return out


@functools.lru_cache(maxsize=None)
def _hints(schema: type) -> dict[str, Any]:
    return typing.get_type_hints(schema)


def _walk(data: dict, schema: type, prefix: str, root: DictConfig, check_paths: bool, out: list,
          nested: dict[str, type]) -> None:
    hints = _hints(schema)
    for f in dataclasses.fields(schema):
        key = prefix + f.name
        value = data.get(f.name, MISSING)
        child = nested.get(key) or hints.get(f.name)
        if isinstance(value, dict) and dataclasses.is_dataclass(child):
            stage = key.split(".")[1] if key.startswith("stages.") and key.count(".") == 1 else None
            _walk(value, child, key + ".", root, check_paths and (stage is None or bool(value.get("enabled"))),
                  out, nested)
            continue
        rule = rule_of(f)
        if rule is None or value is None or value == MISSING:
            continue
        problem = rule.problem(f.name, value, f.default is None, root, check_paths)
        if problem:
            out.append((key, value, problem))
