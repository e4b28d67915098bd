"""The tiny models the project builds itself: HF checkpoints (Qwen3-MoE, and a Nemotron-H
hybrid) trained on CPU on a synthetic MMLU-format task, built deterministically and cached
(see build.py)."""
from launcher_testing.tiny.build import (MODEL_NAME, NEMOTRON_H_NAME, TINY_MODELS, default_dir, ensure_tiny_model,
                                 read_build_info, recipe_hash)
from launcher_testing.tiny.train import Recipe

__all__ = ["MODEL_NAME", "NEMOTRON_H_NAME", "TINY_MODELS", "Recipe", "default_dir", "ensure_tiny_model",
           "read_build_info", "recipe_hash"]
