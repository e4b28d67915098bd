"""The tiny embedded-default model: a Qwen3-MoE-shaped HF checkpoint trained on CPU on a
synthetic MMLU-format task, built deterministically and cached (see build.py)."""
from launcher.tiny.build import MODEL_NAME, default_dir, ensure_tiny_model, read_build_info, recipe_hash
from launcher.tiny.train import Recipe

__all__ = ["MODEL_NAME", "Recipe", "default_dir", "ensure_tiny_model", "read_build_info", "recipe_hash"]
