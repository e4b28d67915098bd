"""Where the launcher's files are: the package, the repository, its recipes, the build cache.

Pure (no launcher import, no Hydra): every layer may name these.
"""
from __future__ import annotations

import glob
import os

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(PACKAGE_DIR)
RECIPES_DIR = os.environ.get("PTQ_RECIPES_DIR", os.path.join(REPO_ROOT, "recipes"))


def yaml_options(directory: str) -> dict[str, str]:
    """{name: path} of every directory/<name>.yaml, sorted by path (a Hydra group's options)."""
    return {os.path.splitext(os.path.basename(p))[0]: p
            for p in sorted(glob.glob(os.path.join(directory, "*.yaml")))}


def recipe_names() -> list[str]:
    """The recipes there are: the names of RECIPES_DIR/<name>.yaml, sorted."""
    return sorted(yaml_options(RECIPES_DIR))


def cache_dir() -> str:
    """Where built artefacts (the tiny model, its data) live: $PTQ_CACHE_DIR or <repo>/.cache."""
    return os.path.abspath(os.environ.get("PTQ_CACHE_DIR", os.path.join(REPO_ROOT, ".cache")))
