"""Read the layout of a safetensors checkpoint directory from file headers only (no torch).

A safetensors file starts with an 8-byte little-endian header length and a JSON header
``{name: {"dtype", "shape", "data_offsets"}, "__metadata__": {...}}``; reading it costs a few
kilobytes however large the checkpoint, so the layout checks scale to 100+ GB exports.
"""
from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"

# safetensors dtype code -> torch dtype name
DTYPE_NAMES = {
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "I32": "int32", "I64": "int64",
    "F16": "float16", "BF16": "bfloat16", "F32": "float32", "F64": "float64",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
}
DTYPE_BYTES = {"bool": 1, "uint8": 1, "int8": 1, "int16": 2, "int32": 4, "int64": 8, "float16": 2,
               "bfloat16": 2, "float32": 4, "float64": 8, "float8_e4m3fn": 1, "float8_e5m2": 1}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    file: str          # file name inside the directory
    dtype: str         # torch dtype name, e.g. "bfloat16", "uint8", "float8_e4m3fn"
    shape: tuple

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def read_header(path: str) -> dict[str, TensorInfo]:
    """Tensor name -> TensorInfo for one .safetensors file (ValueError if it is not one)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path}: not a safetensors file ({size} bytes)")
        (n,) = struct.unpack("<Q", raw)
        if n > size - 8:
            raise ValueError(f"{path}: corrupt safetensors header (claims {n} bytes, file has {size})")
        header = json.loads(f.read(n))
    name = os.path.basename(path)
    out = {}
    for key, meta in header.items():
        if key == "__metadata__":
            continue
        dtype = DTYPE_NAMES.get(meta["dtype"], meta["dtype"])
        out[key] = TensorInfo(key, name, dtype, tuple(meta["shape"]))
    return out


def safetensors_files(directory: str) -> list[str]:
    return sorted(n for n in os.listdir(directory) if n.endswith(".safetensors"))


def read_index(directory: str) -> dict | None:
    path = os.path.join(directory, INDEX_NAME)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        try:
            index = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(index, dict) or not isinstance(index.get("weight_map"), dict):
        raise ValueError(f"{path}: no 'weight_map' object")
    return index


def read_all_headers(directory: str) -> tuple[dict[str, TensorInfo], list[str]]:
    """Every tensor of every .safetensors file in ``directory``, and duplicate-name problems."""
    tensors: dict[str, TensorInfo] = {}
    problems = []
    for name in safetensors_files(directory):
        for key, info in read_header(os.path.join(directory, name)).items():
            if key in tensors:
                problems.append(f"tensor {key} is stored twice: in {tensors[key].file} and in {name}")
            tensors[key] = info
    return tensors, problems


def checkpoint_tensor_names(directory: str) -> dict[str, TensorInfo]:
    """The tensors of every .safetensors file of an HF checkpoint directory (from headers)."""
    tensors, _ = read_all_headers(directory)
    if not tensors:
        raise ValueError(f"{directory} holds no .safetensors files")
    return tensors


def load_tensors(directory: str, names, where: dict[str, TensorInfo]):
    """name -> torch tensor for ``names`` (grouped by file, loaded with safetensors)."""
    from safetensors import safe_open

    by_file: dict[str, list[str]] = {}
    for n in names:
        by_file.setdefault(where[n].file, []).append(n)
    out = {}
    for fname, keys in by_file.items():
        with safe_open(os.path.join(directory, fname), framework="pt", device="cpu") as f:
            for k in keys:
                out[k] = f.get_tensor(where[k].name)   # the stored name (callers may key by an alias)
    return out
