"""mamba_ssm without its CUDA extension: the one place that makes ``import mamba_ssm`` work.

Megatron-Core's Mamba mixer needs three things from mamba_ssm: the Mamba-2 chunked-scan kernel
(``ops.triton.ssd_combined.mamba_chunk_scan_combined``), the gated RMSNorm
(``ops.triton.layernorm_gated.RMSNorm``) and, for training only, the fused conv+scan.  All three
are triton kernels shipped as Python, and mamba_ssm also ships pure-torch references of them.
The package's compiled extension ``selective_scan_cuda`` is Mamba-1's selective scan, which a
Mamba-2 model never calls.

``scripts/setup_venv.sh`` (CPU) and the H200 wheel set (``benchmarks/README.md``) install a
mamba_ssm wheel built without that extension::

    MAMBA_SKIP_CUDA_BUILD=TRUE MAMBA_FORCE_BUILD=TRUE \
        pip wheel --no-deps --no-build-isolation mamba-ssm==2.3.2.post1

(without ``MAMBA_FORCE_BUILD`` setup.py tries to download a prebuilt CUDA wheel).  Such a build
fails at ``import mamba_ssm``: its ``__init__`` imports ``selective_scan_cuda`` unconditionally,
and megatron.core.ssm.mamba_mixer then records ``HAVE_MAMBA_SSM = False`` for good.
``ensure_mamba_ssm_importable()`` registers a stand-in ``selective_scan_cuda`` module that
raises on first use, so the import succeeds and Mamba-1's kernel still fails loudly if anything
ever calls it.  It must run before ``megatron.core.ssm`` is first imported; this package's
``__init__`` calls it.  Where the real extension is installed nothing is changed.
"""
from __future__ import annotations

import importlib.util
import sys
import types

EXTENSION = "selective_scan_cuda"


class _MissingExtension(types.ModuleType):
    """Stands in for mamba_ssm's compiled Mamba-1 kernel module; any attribute use raises."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        raise ImportError(
            f"{EXTENSION}.{name}: mamba_ssm was installed without its CUDA extension "
            f"(MAMBA_SKIP_CUDA_BUILD=TRUE); Mamba-1's selective scan is unavailable. Mamba-2 "
            f"(Nemotron-H) uses mamba_ssm's triton kernels and does not need it.")


def ensure_mamba_ssm_importable() -> str:
    """Make ``import mamba_ssm`` work without its CUDA extension. Returns what was found:
    "absent" (no mamba_ssm), "full" (extension present) or "stubbed" (stand-in registered)."""
    if importlib.util.find_spec("mamba_ssm") is None:
        return "absent"
    existing = sys.modules.get(EXTENSION)
    if isinstance(existing, _MissingExtension):
        return "stubbed"
    if existing is not None or importlib.util.find_spec(EXTENSION) is not None:
        return "full"
    sys.modules[EXTENSION] = _MissingExtension(EXTENSION)
    return "stubbed"


def megatron_mamba_status() -> tuple[bool, str]:
    """(usable, reason): can megatron.core.ssm build a MambaMixer in this process?"""
    state = ensure_mamba_ssm_importable()
    if state == "absent":
        return False, ("the mamba_ssm package is not installed (scripts/setup_venv.sh builds it "
                       "without its CUDA extension; see launcher/megatron/mamba_ssm_compat.py)")
    try:
        import einops  # noqa: F401
    except ImportError:
        return False, "mamba_ssm needs the einops package, which is not installed"
    import megatron.core.ssm.mamba_mixer as mixer

    if not mixer.HAVE_MAMBA_SSM:
        try:
            import mamba_ssm.ops.triton.ssd_combined  # noqa: F401  (the error, for the message)
        except Exception as e:  # noqa: BLE001 - reported to the user
            return False, f"megatron.core cannot import mamba_ssm's kernels: {type(e).__name__}: {e}"
        return False, ("megatron.core.ssm.mamba_mixer was imported before mamba_ssm could be; "
                       "import launcher.megatron before megatron.core.ssm")
    return True, f"mamba_ssm {state}"
