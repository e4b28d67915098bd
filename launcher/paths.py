"""Where the launcher's files are: the package, the repository, its recipes, the build cache.

Pure (no launcher import, no Hydra): every layer may name these.
"""
from __future__ import annotations

import glob
import os

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(PACKAGE_DIR)
RECIPES_DIR = os.environ.get("PTQ_RECIPES_DIR", os.path.join(REPO_ROOT, "recipes"))


def recipe_names() -> list[str]:
    """The recipes there are: the names of RECIPES_DIR/<name>.yaml, sorted."""
    return sorted(os.path.splitext(os.path.basename(p))[0] for p in glob.glob(os.path.join(RECIPES_DIR, "*.yaml")))


def cache_dir() -> str:
    """Where built artefacts (the tiny model, its data) live: $PTQ_CACHE_DIR or <repo>/.cache."""
    return os.path.abspath(os.environ.get("PTQ_CACHE_DIR", os.path.join(REPO_ROOT, ".cache")))
