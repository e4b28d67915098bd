"""Build (or reuse) a tiny model, its MMLU-format task and calibration text.

Two tiny models (``TINY_MODELS``): the embedded default ``Qwen3-MoE-tiny`` and the Nemotron-H
hybrid ``NemotronH-MoE-tiny`` (Mamba-2 + MoE with a shared expert + attention, shaped like
Nemotron-3-Nano).  Both learn the same synthetic task from the same tokenizer recipe.

Layout of a build directory (default `<cache_dir()>/tiny/<name>/`):

    hf/           HF checkpoint (config.json, model.safetensors, fp32) + tokenizer files
    mmlu/         test.jsonl, dev.jsonl (cais/mmlu schema) and data/{test,dev}/<subject>_<split>.csv
    calib.jsonl   {"text": ...} lines from the same corpus
    build.json    recipe, recipe hash, seed, measured accuracy, train time, versions

A build is reused when build.json's recipe hash equals the current one (the hash covers every
recipe field, this package's source code and the torch/transformers versions).  Builds run
under an fcntl lock next to the directory, into a temporary sibling that is renamed into
place (``launcher_testing.locked_build``), so concurrent callers build once and nobody ever
sees a half-built directory.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Callable

from launcher_testing.locked_build import locked_build, read_build_info
from launcher_testing.tiny.train import Recipe

MODEL_NAME = "Qwen3-MoE-tiny"
NEMOTRON_H_NAME = "NemotronH-MoE-tiny"
TINY_MODELS: dict[str, Recipe] = {
    MODEL_NAME: Recipe(),
    # 8 layers MEM*EMEM: 4 Mamba-2 (8 heads of 32 in 2 groups, state 16), 3 MoE (8 experts top-2
    # + a shared expert, relu2), 1 attention (4 heads, 2 KV, no positions).  It leaves the ln(4)
    # plateau later than the Qwen model (its one attention layer has no positions): zero-shot
    # 0.36 at 800 steps (lr 7e-4), 0.69 at 1800 (1e-3), 0.81 at 2600, 1.00 at 3400 (1e-3).
    NEMOTRON_H_NAME: Recipe(family="nemotron_h", hybrid_pattern="MEM*EMEM", num_layers=8,
                            moe_intermediate_size=128, shared_expert_intermediate_size=256,
                            lr=1e-3, steps=3400),
}
BUILD_VERSION = "tiny-build-1"
_SOURCES = ("synthetic_mmlu.py", "tokenizer.py", "train.py", "build.py")

Log = Callable[[str], None]


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def recipe_hash(recipe: Recipe) -> str:
    import torch
    import transformers

    h = hashlib.sha256()
    h.update(BUILD_VERSION.encode())
    h.update(json.dumps(dataclasses.asdict(recipe), sort_keys=True).encode())
    h.update(f"torch={torch.__version__} transformers={transformers.__version__}".encode())
    # the code, not where its package lives: the package's dotted name is replaced by a placeholder,
    # so moving the package keeps the builds current (the sources name no other location of it)
    here = Path(__file__).resolve().parent
    package = __name__.rpartition(".")[0].encode()
    for name in _SOURCES:
        h.update(name.encode())
        h.update((here / name).read_bytes().replace(package, b"<tiny-package>"))
    return h.hexdigest()[:16]


def _recipe_of(name: str) -> Recipe:
    if name not in TINY_MODELS:
        raise ValueError(f"tiny model {name!r} is not known; valid: {sorted(TINY_MODELS)}")
    return TINY_MODELS[name]


def default_dir(cache_root: str | os.PathLike | None = None, name: str = MODEL_NAME) -> Path:
    _recipe_of(name)
    if cache_root is None:
        from launcher.paths import cache_dir
        cache_root = cache_dir()
    return Path(cache_root).resolve() / "tiny" / name


def is_current(out_dir: str | os.PathLike, recipe: Recipe) -> bool:
    info = read_build_info(out_dir)
    return (info is not None and info.get("recipe_hash") == recipe_hash(recipe)
            and (Path(out_dir) / "hf" / "model.safetensors").is_file())


def ensure_tiny_model(cache_root: str | os.PathLike | None = None, *, name: str = MODEL_NAME,
                      out_dir: str | os.PathLike | None = None, recipe: Recipe | None = None,
                      force: bool = False, log: Log = _stderr) -> Path:
    """Return the tiny model's build directory, building it first unless a current build exists.

    `name` is one of TINY_MODELS (its recipe is the default); `cache_root` defaults to
    launcher.paths.cache_dir(); `out_dir` overrides the whole path (then `cache_root`
    must be None).
    """
    if out_dir is not None and cache_root is not None:
        raise ValueError("give cache_root or out_dir, not both")
    recipe = recipe or _recipe_of(name)
    target = Path(out_dir).resolve() if out_dir is not None else default_dir(cache_root, name)
    return locked_build(target, lambda: is_current(target, recipe),
                        lambda tmp: build_into(tmp, recipe, log, name), force=force)


def build_into(out: Path, recipe: Recipe, log: Log = _stderr, name: str = MODEL_NAME) -> dict:
    """Build everything into the (empty) directory `out`; returns what it writes to build.json."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from launcher_testing.tiny import synthetic_mmlu as sm
    from launcher_testing.tiny.tokenizer import save_tokenizer, train_tokenizer
    from launcher_testing.tiny.train import make_config, model_class, score, train

    t0 = time.perf_counter()
    rhash = recipe_hash(recipe)   # of the code that runs now, not of what is on disk at the end
    threads = torch.get_num_threads()
    det = torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(recipe.threads)
    torch.use_deterministic_algorithms(True)
    try:
        torch.manual_seed(recipe.seed)
        task = sm.TaskGenerator(recipe.seed, recipe.n_test, recipe.n_dev_per_subject, recipe.n_invented)
        tokenizer = train_tokenizer(task.corpus(recipe.tokenizer_corpus_prompts), recipe.tokenizer_vocab)
        calib = task.corpus(recipe.n_calib)[-recipe.n_calib:]
        # Fresh generator: the training stream must not depend on how much text came before.
        task = sm.TaskGenerator(recipe.seed, recipe.n_test, recipe.n_dev_per_subject, recipe.n_invented)
        config = make_config(recipe, tokenizer)
        torch.manual_seed(recipe.seed)
        model = model_class(recipe)(config)
        log(f"[tiny] building {name} in {out}: {sum(p.numel() for p in model.parameters()):,} params, "
            f"{recipe.steps} steps x {recipe.batch_size}")
        t_train = time.perf_counter()
        losses = train(model, tokenizer, task, recipe, log)
        train_s = time.perf_counter() - t_train

        hf = out / "hf"
        model.save_pretrained(hf)
        save_tokenizer(tokenizer, hf)
        sm.write_mmlu(str(out / "mmlu"), task.test, task.dev)
        sm.write_calib(str(out / "calib.jsonl"), calib)

        # Measure from disk, the way the pipeline reads it.
        model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(hf)
        test = sm.read_jsonl(str(out / "mmlu" / "test.jsonl"))
        dev: dict[str, list[dict]] = {}
        for r in sm.read_jsonl(str(out / "mmlu" / "dev.jsonl")):
            dev.setdefault(r["subject"], []).append(r)
        acc0, _ = score(model, tokenizer, test)
        acc5, _ = score(model, tokenizer, test, dev, recipe.n_dev_per_subject)
        log(f"[tiny] accuracy on {len(test)} test questions: zero-shot {acc0:.4f}, "
            f"{recipe.n_dev_per_subject}-shot {acc5:.4f}")
        if acc0 < recipe.min_accuracy:
            raise RuntimeError(f"tiny model reached zero-shot accuracy {acc0:.4f} < min_accuracy "
                               f"{recipe.min_accuracy}; the recipe needs more training")
        info = {
            "model": name,
            "architecture": type(model).__name__,
            "recipe_hash": rhash,
            "build_version": BUILD_VERSION,
            "seed": recipe.seed,
            "recipe": dataclasses.asdict(recipe),
            "dtype": "float32",
            "accuracy": acc0,
            "accuracy_zero_shot": acc0,
            f"accuracy_{recipe.n_dev_per_subject}_shot": acc5,
            "n_test": len(test),
            "n_dev": sum(len(v) for v in dev.values()),
            "n_calib": len(calib),
            "subjects": sorted(dev),
            "final_loss": sum(losses[-20:]) / len(losses[-20:]),
            "train_seconds": round(train_s, 2),
            "build_seconds": round(time.perf_counter() - t0, 2),
            "versions": {"python": platform.python_version(), "torch": torch.__version__,
                         "transformers": transformers.__version__},
            "created_unix": int(time.time()),
        }
        with open(out / "build.json", "w", encoding="utf-8") as f:
            json.dump(info, f, indent=2, sort_keys=True)
            f.write("\n")
        return info
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(det)
