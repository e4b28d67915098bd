#!/usr/bin/env python3
"""TransformerEngine for a GPU node without network, for the trial of issue 22: the files that
build and run ``transformer_engine_torch`` there, pinned by sha256, packed and split into parts.

    # here (package registry reachable): download, check, pack, split
    python3 scripts/te_wheelhouse.py build --out .te-wheelhouse
    # carry .te-wheelhouse/part-NN (+ manifest.json) one per call; there, the vLLM wheelhouse's installer
    python3 scripts/vllm_wheelhouse.py install --parts DIR --target /tmp/te-wheels
    # then `bash scripts/gpu_checks.sh $OUT te-install te-trial` (pip installs the wheels, builds the sdist)

What travels (``FILES``, read from the packages on 2026-12-07):
  * ``transformer-engine-cu13`` 2.20.2: the core library (a 276 MB wheel; xz does not shrink it:
    its CUDA code is already compressed), the headers and the Python package.
  * ``transformer-engine`` 2.20.2: the metapackage. Its wheel repeats the Python package, and
    ``import transformer_engine`` asserts that it is installed ("Could not find
    `transformer-engine`", seen on the H100 on 2026-12-07 without it).
  * ``transformer_engine_torch`` 2.20.2: an sdist only (33 C++ sources against the core's headers
    and torch), built on the node with its nvcc and g++ (``NVTE_PYTORCH_FORCE_BUILD=TRUE``: its
    setup.py otherwise tries to download a prebuilt wheel from GitHub first).
  * Its requirements that the GPU image lacks: ``nvidia-cudnn-frontend`` (headers the build
    includes) and ``nvdlfw-inspect``. The image has einops, onnx, onnxscript, packaging, pybind11
    and wheel; pydantic travels in ``.whl``.
The archive is an uncompressed tar (the files are compressed already), split into parts of at
most ``--part-mib`` MiB, with ``manifest.json`` holding each part's and the archive's sha256.
"""
from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from pathlib import Path

_spec = importlib.util.spec_from_file_location("vllm_wheelhouse", Path(__file__).with_name("vllm_wheelhouse.py"))
wheelhouse = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(wheelhouse)

TE_VERSION = "2.20.2"
PYPI_FILES = "https://files.pythonhosted.org/packages"
# file name -> (how to get it: a pip requirement or a URL, its sha256)
FILES = {
    "transformer_engine_cu13-2.20.2-py3-none-manylinux_2_28_x86_64.whl":
        ("transformer-engine-cu13==2.20.2", "30063d3699e779cce63617c3458804f7a504ce8279f2749c98313db9daae273e"),
    "transformer_engine-2.20.2-py3-none-any.whl":
        ("transformer-engine==2.20.2", "7dcfad943a1a55b2612db9a0e43697fe98c70f4c42ec391ba3a0f872f6ce2094"),
    "transformer_engine_torch-2.20.2.tar.gz":
        (f"{PYPI_FILES}/3d/fb/c9ce298a38c22ed1059923a01cac7e1f4e4f7281d39a8679c8118febe079/"
         "transformer_engine_torch-2.20.2.tar.gz",
         "4c40ced8a6261649e689076f198d4feaf02277b1ba18931a66eccdaceb33c43e"),
    "nvidia_cudnn_frontend-1.32.0-cp312-cp312-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl":
        ("nvidia-cudnn-frontend==1.32.0", "8b354a8e550c083eb247f1eb39a7d69a4a269075f5a01e4fcbd2531680b17239"),
    "nvdlfw_inspect-0.2.2-py3-none-any.whl":
        ("nvdlfw-inspect==0.2.2", "8a4dc2814c5a4cd19ae304170b9bfa514538ef3c3eb243a45a82404ec3cb279d"),
}


def fetch(name: str, source: str, dest: Path, python: str) -> Path:
    """Download one pinned file into ``dest`` (kept when already there with the right sha256)."""
    path = dest / name
    if path.is_file() and wheelhouse.sha256(path) == FILES[name][1]:
        return path
    if source.startswith("https://"):
        urllib.request.urlretrieve(source, path)   # an sdist: pip would build its metadata (torch, CUDA)
    else:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
               "--python-version", python, "--implementation", "cp", "-d", str(dest)]
        for p in wheelhouse.PLATFORMS:
            cmd += ["--platform", p]
        subprocess.run(cmd + [source], check=True)
    if not path.is_file():
        raise SystemExit(f"[te-wheelhouse] {source} did not give {name}")
    return path


def verified(paths: list[Path]) -> list[str]:
    """``name --hash=sha256:...`` for each file; a SystemExit naming any whose sha256 is not the pin."""
    bad = [f"{p.name}: sha256 {wheelhouse.sha256(p)}, pinned {FILES[p.name][1]}"
           for p in paths if wheelhouse.sha256(p) != FILES[p.name][1]]
    if bad:
        raise SystemExit("[te-wheelhouse] not the pinned files: " + "; ".join(bad))
    return [f"{p.name} --hash=sha256:{FILES[p.name][1]}" for p in paths]


def pack(paths: list[Path], out: Path, part_mib: int, label: str) -> dict:
    """An uncompressed tar of ``paths`` split into ``out/part-NN``; returns the manifest it writes."""
    with tempfile.TemporaryDirectory(dir=out) as tmp:
        archive = Path(tmp) / "site.tar"
        with tarfile.open(archive, "w") as tar:
            for p in paths:
                tar.add(p, arcname=p.name)
        return wheelhouse.write_parts(archive, out, part_mib, label=label, compression="",
                                      files=[p.name for p in paths])


def build(args) -> None:
    t0 = time.time()
    out = Path(args.out)
    files = out / "files"
    files.mkdir(parents=True, exist_ok=True)
    paths = [fetch(name, source, files, args.python) for name, (source, _) in FILES.items()]
    lock = verified(paths)
    (out / "lock.txt").write_text("\n".join(lock) + "\n")
    manifest = pack(paths, out, args.part_mib, f"TransformerEngine {TE_VERSION} (wheels and sdist)")
    print(f"[te-wheelhouse] {len(paths)} files, {manifest['archive_bytes'] / 1e6:.0f} MB in "
          f"{len(manifest['parts'])} parts of <= {args.part_mib} MiB, in {time.time() - t0:.0f} s -> {out}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="verb", required=True)
    b = sub.add_parser("build", help="download the pinned files, pack and split (needs a package registry)")
    b.add_argument("--out", default=".te-wheelhouse")
    b.add_argument("--python", default="3.12", help="the node's CPython, major.minor")
    b.add_argument("--part-mib", type=int, default=56)
    args = ap.parse_args(argv)
    build(args)


if __name__ == "__main__":
    main()
