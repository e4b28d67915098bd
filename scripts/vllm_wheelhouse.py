#!/usr/bin/env python3
"""An offline vLLM for a GPU node without network: build a wheelhouse here, carry it in parts,
reassemble and install it there, apart from the project's own packages.

    # here (package registry reachable): resolve, download, install into a staging dir, pack, split
    python3 scripts/vllm_wheelhouse.py build --out .vllm-wheelhouse
    # carry .vllm-wheelhouse/part-NN (+ manifest.json) to the node, one or more per call, then there:
    python3 scripts/vllm_wheelhouse.py install --parts DIR --target /tmp/vllm-site
    # and serve with PYTHONPATH=/tmp/vllm-site (vLLM first), e.g. the smoke stage's `python:` wrapper

What is built (``build``):
  * vLLM ``--vllm`` (0.26.0: the newest release that pins the H200 image's torch 2.11.0) for
    CPython ``--python`` on manylinux x86_64, and the closure of its requirements, resolved from
    the wheels' own metadata (markers evaluated for that interpreter), **minus** the packages the
    node's image already has (``--have``: one name per line, ``#`` comments) and minus
    ``EXCLUDED``: optional kernel and media packages that vLLM imports lazily and that serving
    the project's exports (Llama, Qwen3-MoE, Nemotron-H; bf16, FP8, NVFP4) does not load.
    ``OVERRIDES`` replaces a requirement's specifier where a pin serves only what is left out.
  * ``lock.txt``: every wheel as ``name==version --hash=sha256:...`` (pip's hash-checking form).
  * The wheels are installed (``pip install --no-deps --target``) into a staging dir, files that
    the target does not use are dropped (``DROPPED``: FlashAttention-2's 305 MB library, unused on
    Hopper where vLLM takes FlashAttention-3; deep_gemm's builds for other Pythons), and the dir
    is packed as one tar archive, ``--compression gz`` (default: about as small as the wheels' zip,
    and fast) or ``xz`` (smaller, but slow to pack: 0.2 MB/s of input was measured for
    FlashAttention-3's library on a 2-core machine under a load average of 30).
  * The archive is split into ``part-NN`` files of at most ``--part-mib`` MiB; ``manifest.json``
    holds each part's and the whole archive's sha256 and size.

``install`` checks every part against the manifest (naming any missing or corrupt one), checks
the reassembled archive's sha256, and unpacks it into ``--target`` (standard library only: the
node needs no gzip or xz binary).  It is idempotent: a target stamped with the manifest's digest is kept.
"""
from __future__ import annotations

import argparse
import concurrent.futures as futures
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from pathlib import Path

# optional packages vLLM imports lazily (kernels for other GPUs or other models, video decode);
# none is loaded when the smoke serves the project's exports on Hopper
EXCLUDED = {
    "flashinfer-python": "FlashInfer kernels: optional backend (sampling, Blackwell FP4 GEMM/MoE)",
    "flashinfer-cubin": "FlashInfer's prebuilt kernels",
    "tilelang": "TileLang kernels (optional MLA/sparse attention)",
    "torchcodec": "video/audio decoding (multimodal inputs)",
    "pynvvideocodec": "NVIDIA video decoding (multimodal inputs)",
    "nvidia-cudnn-frontend": "cuDNN attention frontend (optional backend)",
    "nvidia-cutlass-dsl": "CuTe DSL kernels (Blackwell)",
    "quack-kernels": "CuTe DSL kernels (Blackwell)",
    "tokenspeed-mla": "MLA kernels (DeepSeek-style attention)",
    "humming-kernels": "optional quantized GEMM kernels",
    "fastsafetensors": "GPU-direct safetensors loading (optional loader)",
    "nvidia-cudnn-cu13": "on the image with torch",
}
# a package whose specifier is replaced: vLLM 0.26.0 pins apache-tvm-ffi==0.1.10 for FlashInfer (not
# carried), but xgrammar 0.2.9, which vLLM imports to serve, needs >=0.1.11 (measured on the H200:
# with 0.1.10, xgrammar's import fails; with 0.1.15.post2 the OpenAI server imports and serves)
OVERRIDES = {
    "apache-tvm-ffi": ">=0.1.11",
}
# files of the installed vLLM the target does not use
DROPPED = [
    ("vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so", "FlashAttention-2 (Ampere); Hopper runs FlashAttention-3"),
    (r"vllm/third_party/deep_gemm/_C\.cpython-3(?!{minor})\d+-x86_64-linux-gnu\.so", "deep_gemm for other Pythons"),
]
PLATFORMS = ["manylinux2014_x86_64", "manylinux1_x86_64"] + [f"manylinux_2_{n}_x86_64" for n in range(17, 40)]


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_have(path: str) -> set[str]:
    names = set()
    for line in Path(path).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            names.add(canonical(re.split(r"[=<>!~ ]", line, maxsplit=1)[0]))
    return names


def marker_env(python: str) -> dict:
    return {"python_version": python, "python_full_version": python + ".0", "sys_platform": "linux",
            "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
            "implementation_name": "cpython", "platform_python_implementation": "CPython",
            "platform_release": "", "platform_version": "", "implementation_version": python + ".0"}


def wheel_requires(wheel: Path, extras: set[str], env: dict) -> list:
    """The wheel's Requires-Dist entries that apply for ``env`` with ``extras`` requested."""
    from packaging.requirements import Requirement
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode()
    out = []
    for line in text.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        req = Requirement(line.split(":", 1)[1].strip())
        if req.marker is None or any(req.marker.evaluate({**env, "extra": e}) for e in (extras or {""})):
            out.append(req)
    return out


def pip_download(spec: str, dest: Path, python: str) -> Path:
    """Download the newest wheel satisfying ``spec`` into ``dest`` (through a private temp dir, so
    concurrent calls never see each other's files)."""
    tmp = Path(tempfile.mkdtemp(dir=dest, prefix=".dl-"))
    try:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
               "--python-version", python, "--implementation", "cp", "-d", str(tmp), spec]
        for p in PLATFORMS:
            cmd += ["--platform", p]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"pip download {spec!r} failed:\n{r.stderr[-2000:]}")
        got = list(tmp.glob("*.whl"))
        assert len(got) == 1, f"pip download {spec!r} gave {got}"
        return Path(shutil.move(str(got[0]), dest / got[0].name))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def resolve(root_spec: str, dest: Path, python: str, have: set[str]) -> dict[str, Path]:
    """Breadth-first over requirements: each package once, the first specifier seen wins (pip
    download picks its newest wheel that satisfies it)."""
    from packaging.requirements import Requirement
    env = marker_env(python)
    wheels: dict[str, Path] = {}
    extras: dict[str, set[str]] = {}
    queue = [Requirement(root_spec)]
    skipped: dict[str, str] = {}
    with futures.ThreadPoolExecutor(4) as pool:
        while queue:
            batch, queue = queue, []
            todo = {}
            for req in batch:
                name = canonical(req.name)
                if name in have:
                    skipped.setdefault(name, "on the image")
                    continue
                if name in EXCLUDED:
                    skipped.setdefault(name, EXCLUDED[name])
                    continue
                new_extras = set(req.extras) - extras.get(name, set())
                if name in wheels or name in todo:
                    if new_extras:   # an extra asked for later: follow its requirements too
                        extras[name] |= new_extras
                        if name in wheels:
                            queue += wheel_requires(wheels[name], new_extras, env)
                    continue
                extras[name] = set(req.extras)
                todo[name] = pool.submit(pip_download, f"{req.name}{OVERRIDES.get(name, req.specifier)}", dest, python)
            for name, fut in todo.items():
                wheels[name] = fut.result()
                print(f"[wheelhouse] {wheels[name].name}", flush=True)
                queue += wheel_requires(wheels[name], extras[name], env)
    for name, why in sorted(skipped.items()):
        print(f"[wheelhouse] not carried: {name} ({why})")
    return wheels


def sha256(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def stage_install(wheels: list[Path], staging: Path, python: str) -> list[str]:
    """pip-install the wheels into ``staging`` (no deps, no bytecode); drop DROPPED files."""
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile", "--only-binary=:all:",
           "--python-version", python, "--implementation", "cp", "--target", str(staging)]
    for p in PLATFORMS:
        cmd += ["--platform", p]
    subprocess.run(cmd + [str(w) for w in wheels], check=True)
    minor = python.split(".")[1]
    dropped = []
    for pattern, why in DROPPED:
        rx = re.compile(pattern.replace("{minor}", minor) + "$")
        for f in staging.rglob("*"):
            rel = f.relative_to(staging).as_posix()
            if f.is_file() and rx.match(rel):
                dropped.append(f"{rel} ({f.stat().st_size >> 20} MiB): {why}")
                f.unlink()
    return dropped


def split(archive: Path, out: Path, part_mib: int) -> list[dict]:
    parts, size = [], part_mib << 20
    with open(archive, "rb") as f:
        i = 0
        while block := f.read(size):
            p = out / f"part-{i:02d}"
            p.write_bytes(block)
            parts.append({"name": p.name, "bytes": len(block), "sha256": hashlib.sha256(block).hexdigest()})
            i += 1
    return parts


def write_parts(archive: Path, out: Path, part_mib: int, **fields) -> dict:
    """``archive`` split into ``out/part-NN`` (earlier parts removed) and ``out/manifest.json``:
    ``fields``, then the archive's and each part's sha256 and size (what ``install`` checks).
    Returns the manifest."""
    for old in out.glob("part-*"):
        old.unlink()
    parts = split(archive, out, part_mib)
    manifest = {**fields, "archive_sha256": sha256(archive), "archive_bytes": archive.stat().st_size,
                "parts": parts}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def build(args) -> None:
    t0 = time.time()
    out = Path(args.out)
    wheel_dir = out / "wheels"
    wheel_dir.mkdir(parents=True, exist_ok=True)
    have = read_have(args.have) if args.have else set()
    wheels = resolve(f"vllm=={args.vllm}", wheel_dir, args.python, have)
    assert len(set(wheels.values())) == len(wheels), "two packages resolved to one wheel file"
    lock = sorted(f"{w.name.split('-')[0]}=={w.name.split('-')[1]} --hash=sha256:{sha256(w)}" for w in wheels.values())
    (out / "lock.txt").write_text("\n".join(lock) + "\n")
    wheel_mb = sum(w.stat().st_size for w in wheels.values()) / 1e6
    print(f"[wheelhouse] {len(wheels)} wheels, {wheel_mb:.0f} MB; lock.txt written")
    with tempfile.TemporaryDirectory(dir=out) as tmp:
        staging = Path(tmp) / "site"
        dropped = stage_install(list(wheels.values()), staging, args.python)
        for d in dropped:
            print(f"[wheelhouse] dropped {d}")
        archive = Path(tmp) / f"site.tar.{args.compression}"
        print(f"[wheelhouse] packing ({args.compression})...", flush=True)
        level = {"gz": {"compresslevel": 6}, "xz": {"preset": 6}}[args.compression]
        with tarfile.open(archive, f"w:{args.compression}", **level) as tar:
            tar.add(staging, arcname=".")
        manifest = write_parts(archive, out, args.part_mib, vllm=args.vllm, python=args.python,
                               compression=args.compression, dropped=dropped, wheels=lock,
                               excluded=EXCLUDED, overrides=OVERRIDES)
    print(f"[wheelhouse] {len(manifest['parts'])} parts of <= {args.part_mib} MiB, archive "
          f"{manifest['archive_bytes'] / 1e6:.0f} MB, in {time.time() - t0:.0f} s -> {out}")


def install(args) -> None:
    parts_dir = Path(args.parts)
    manifest = json.loads((parts_dir / "manifest.json").read_text())
    target = Path(args.target)
    what = manifest.get("label") or f"vLLM {manifest['vllm']}"   # scripts/te_wheelhouse.py sets a label
    stamp = target / ".wheelhouse-installed"
    if stamp.is_file() and stamp.read_text().strip() == manifest["archive_sha256"]:
        print(f"[wheelhouse] {target} already holds {what}")
        return
    problems = []
    for p in manifest["parts"]:
        f = parts_dir / p["name"]
        if not f.is_file():
            problems.append(f"{p['name']}: missing")
        elif f.stat().st_size != p["bytes"] or sha256(f) != p["sha256"]:
            problems.append(f"{p['name']}: size or sha256 differs from manifest.json")
    if problems:
        raise SystemExit("[wheelhouse] cannot install: " + "; ".join(problems))
    whole = hashlib.sha256()
    with tempfile.TemporaryDirectory() as tmp:
        archive = Path(tmp) / "site.tar"
        with open(archive, "wb") as out:
            for p in manifest["parts"]:
                block = (parts_dir / p["name"]).read_bytes()
                whole.update(block)
                out.write(block)
        if whole.hexdigest() != manifest["archive_sha256"]:
            raise SystemExit("[wheelhouse] the reassembled archive's sha256 differs from manifest.json")
        if target.exists():
            shutil.rmtree(target)
        target.mkdir(parents=True)
        with tarfile.open(archive, f"r:{manifest['compression']}") as tar:
            tar.extractall(target, filter="data")
    stamp.write_text(manifest["archive_sha256"] + "\n")
    print(f"[wheelhouse] installed {what} into {target}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="verb", required=True)
    b = sub.add_parser("build", help="resolve, download, pack and split (needs a package registry)")
    b.add_argument("--out", default=".vllm-wheelhouse")
    b.add_argument("--vllm", default="0.26.0")
    b.add_argument("--python", default="3.12", help="the node's CPython, major.minor")
    b.add_argument("--have", default=str(Path(__file__).with_name("h200_image_packages.txt")),
                   help="packages the node's image already has, one name per line ('' for none)")
    b.add_argument("--part-mib", type=int, default=56)
    b.add_argument("--compression", choices=("gz", "xz"), default="gz")
    i = sub.add_parser("install", help="verify the parts, reassemble, unpack into --target")
    i.add_argument("--parts", required=True, help="a dir with manifest.json and the part-NN files")
    i.add_argument("--target", required=True)
    args = ap.parse_args(argv)
    build(args) if args.verb == "build" else install(args)


if __name__ == "__main__":
    main()
