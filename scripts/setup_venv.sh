#!/usr/bin/env bash
# Set up .venv for the launcher and the CPU worker (torch CPU, megatron-core from sdist, ModelOpt).
# Idempotent: a stamp file records success.
set -euo pipefail
VENV=${VENV:-.venv}
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
STAMP="$VENV/.setup-done-v5"
if [[ -f "$STAMP" ]]; then exit 0; fi
if [[ -f "$VENV/.setup-done-v4" ]]; then
  # a v4 venv lacks only what the test extra has gained since (pytest-xdist, for make test's workers)
  "$VENV/bin/python" -m pip install -q -e '.[test,report]'
  touch "$STAMP"
  exit 0
fi
echo "[setup] creating $VENV (one time, ~3-5 min)"
"$PY" -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
$PIP install -q --upgrade pip wheel setuptools
# torch 2.13.0: this machine serves a local CPU wheel for it; any newer torch is a multi-GB CUDA build.
$PIP install -q torch==2.13.0
$PIP install -q numpy packaging pybind11
# megatron-core >= 0.17 ships cp312-only wheels; the 0.19.2 sdist builds on 3.11.
# --no-deps: --ignore-requires-python would otherwise also pick a cp312-only numpy sdist.
$PIP install -q --ignore-requires-python --no-deps --no-binary megatron-core megatron-core==0.19.2
# modelopt[hf] pins transformers < 5.15; requests (modelopt import) and psutil (dist-ckpt async
# writer) are undeclared runtime deps; triton is imported unconditionally by megatron.core 0.19.2.
$PIP install -q nvidia-modelopt==0.47.0 'transformers>=4.57,<5.15' safetensors tokenizers \
    datasets requests psutil triton
# gguf + accelerate: transformers' GGUF loader (python -m launcher_testing.models smollm2 converts a PyPI GGUF).
$PIP install -q gguf==0.19.0 accelerate==1.16.0
# mamba_ssm (Nemotron-H's Mamba-2 mixer) without its CUDA extension: its triton kernels and
# pure-torch references are Python; `import mamba_ssm` is made to work without the extension in
# one place, launcher/megatron/mamba_ssm_compat.py.  MAMBA_FORCE_BUILD: otherwise setup.py tries
# to download a prebuilt CUDA wheel.  --no-deps: its declared deps (tilelang, quack-kernels, ...)
# serve other kernels; Megatron's Mamba mixer needs einops only.
MAMBA_SKIP_CUDA_BUILD=TRUE MAMBA_FORCE_BUILD=TRUE $PIP install -q --no-deps --no-build-isolation \
    mamba-ssm==2.3.2.post1
$PIP install -q einops
$PIP install -q -e '.[test,report]'
touch "$STAMP"
echo "[setup] done"
