"""scripts/torch_ext_cache.sh with a real ninja: a carried extension build is reused on a host where
pip has just rewritten the sources, but only for the ModelOpt version it was built with.

The build is a one-rule ninja file that copies the "kernel source"; torch's JIT extension loader runs
ninja the same way at every load (a rebuild of ModelOpt's FP8 extension cost 49 s on an H100)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "torch_ext_cache.sh")
NINJA = shutil.which("ninja") or shutil.which("ninja", path=os.path.dirname(sys.executable))

pytestmark = pytest.mark.skipif(NINJA is None, reason="needs a ninja binary (the venv's ninja package ships one)")


def _cache(verb: str, a: str, b: str, version: str, kernels: str) -> str:
    env = {**os.environ, "MODELOPT_VERSION": version, "MODELOPT_KERNELS": kernels}
    p = subprocess.run(["bash", SCRIPT, verb, a, b], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout


def _ninja(ext: str) -> str:
    p = subprocess.run([NINJA, "-C", ext], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout


@pytest.fixture
def built(tmp_path):
    """A kernel source and an extension dir where ninja built it, packed with version 0.47.0."""
    kernels = tmp_path / "site" / "modelopt" / "torch" / "kernels"
    kernels.mkdir(parents=True)
    (kernels / "fp8.cu").write_text("__global__ void k() {}\n")
    ext = tmp_path / "ext"
    ext.mkdir()
    (ext / "build.ninja").write_text(f"rule cc\n  command = cp $in $out\nbuild fp8.o: cc {kernels / 'fp8.cu'}\n")
    assert "cp " in _ninja(str(ext))
    tgz = str(tmp_path / "torch_ext.tgz")
    out = _cache("pack", str(ext), tgz, "0.47.0", str(kernels))
    assert "(ModelOpt 0.47.0)" in out
    return kernels, tgz


def _fresh_host(kernels, tmp_path) -> str:
    """pip rewrites the sources now (newer than the build's log entry); an empty extension dir."""
    later = time.time() + 5
    os.utime(kernels / "fp8.cu", (later, later))
    return str(tmp_path / "fresh-ext")


@pytest.mark.parametrize("installed, said, ninja_says", [
    ("0.47.0", "the carried build of ModelOpt 0.47.0 is reused", "no work to do"),              # the same ModelOpt
    ("0.48.0", "the carried build is of ModelOpt '0.47.0', this is '0.48.0'", "cp "),          # another: rebuilt
])
def test_a_carried_build_is_reused_only_for_the_modelopt_it_was_built_with(built, tmp_path, installed, said,
                                                                            ninja_says):
    kernels, tgz = built
    ext = _fresh_host(kernels, tmp_path)
    out = _cache("unpack", tgz, ext, installed, str(kernels))
    assert said in out
    assert ninja_says in _ninja(ext)


def test_without_the_date_back_ninja_rebuilds_the_carried_build(built, tmp_path):
    """What the script works around: the carried build alone, sources newer than its log."""
    kernels, tgz = built
    ext = _fresh_host(kernels, tmp_path)
    os.makedirs(ext)
    subprocess.run(["tar", "-C", ext, "-xzmf", tgz], check=True)
    assert "cp " in _ninja(ext)


def test_an_unknown_verb_is_refused():
    p = subprocess.run(["bash", SCRIPT, "restore", "a", "b"], capture_output=True, text=True, timeout=30)
    assert p.returncode == 2 and "unknown verb 'restore' (valid: pack, unpack)" in p.stderr
