"""The tiny builds' recipe hash covers the build code, not the package's location: a copy of the
package under another dotted name hashes the same (so moving it keeps the cached builds current),
and a change to the code changes the hash."""
from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.torch

import launcher_testing.tiny.build as build  # noqa: E402

_HERE = Path(build.__file__).resolve().parent
_PACKAGE = build.__name__.rpartition(".")[0]


def _copy_package(root: Path, dotted: str, edit: str = "") -> None:
    pkg_dir = root.joinpath(*dotted.split("."))
    pkg_dir.mkdir(parents=True)
    for parent in list(pkg_dir.relative_to(root).parents)[:-1]:
        (root / parent / "__init__.py").touch()
    for src in _HERE.glob("*.py"):
        text = src.read_text().replace(_PACKAGE, dotted)
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


def test_hashed_sources_name_no_other_location_of_the_package():
    """Only the package's own dotted name is replaced before hashing: a source that spells another
    one (an old or a future location, say in a comment) would change the hash when the package moves."""
    for name in build._SOURCES:
        text = (_HERE / name).read_text().replace(_PACKAGE, "<tiny-package>")
        other = re.search(r"[\w.]*\w\.tiny\b", text)
        assert other is None, f"{name} names {other.group()}"
