"""The tiny builds' recipe hash covers the build code, not the package's location: a copy of the
package under another dotted name hashes the same (so moving it keeps the cached builds current),
and a change to the code changes the hash."""
from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.torch

import launcher.tiny.build as build  # noqa: E402

_HERE = Path(build.__file__).resolve().parent


def _copy_package(root: Path, dotted: str, edit: str = "") -> None:
    pkg_dir = root.joinpath(*dotted.split("."))
    pkg_dir.mkdir(parents=True)
    for parent in list(pkg_dir.relative_to(root).parents)[:-1]:
        (root / parent / "__init__.py").touch()
    for src in _HERE.glob("*.py"):
        text = src.read_text().replace("launcher.tiny", dotted)
        if src.name == "train.py":
            text += edit
        (pkg_dir / src.name).write_text(text)


def _hash_of_copy(tmp_path: Path, dotted: str, edit: str = "") -> str:
    _copy_package(tmp_path, dotted, edit)
    sys.path.insert(0, str(tmp_path))
    try:
        copy = importlib.import_module(f"{dotted}.build")
        train = importlib.import_module(f"{dotted}.train")
        return copy.recipe_hash(train.Recipe())
    finally:
        sys.path.remove(str(tmp_path))
        for name in [n for n in sys.modules if n == dotted.split(".")[0] or n.startswith(dotted.split(".")[0] + ".")]:
            del sys.modules[name]


def test_moved_package_hashes_the_same(tmp_path):
    original = build.recipe_hash(build.TINY_MODELS[build.MODEL_NAME])
    assert _hash_of_copy(tmp_path, "moved_pkg_a.tiny") == original


def test_changed_code_changes_the_hash(tmp_path):
    original = build.recipe_hash(build.TINY_MODELS[build.MODEL_NAME])
    assert _hash_of_copy(tmp_path, "moved_pkg_b.tiny", edit="\n# a change\n") != original
