"""mamba_ssm without its CUDA extension: the one place that makes ``import mamba_ssm`` work.

Megatron-Core's Mamba mixer needs three things from mamba_ssm: the Mamba-2 chunked-scan kernel
(``ops.triton.ssd_combined.mamba_chunk_scan_combined``), the gated RMSNorm
(``ops.triton.layernorm_gated.RMSNorm``) and, for training only, the fused conv+scan.  All three
are triton kernels shipped as Python, and mamba_ssm also ships pure-torch references of them.
The package's compiled extension ``selective_scan_cuda`` is Mamba-1's selective scan, which a
Mamba-2 model never calls.

``scripts/setup_venv.sh`` (CPU) and the H200 wheel set (``benchmarks/README.md``) install a
mamba_ssm wheel built without that extension::

    MAMBA_SKIP_CUDA_BUILD=TRUE MAMBA_FORCE_BUILD=TRUE \\
        pip wheel --no-deps --no-build-isolation mamba-ssm==2.3.2.post1

(without ``MAMBA_FORCE_BUILD`` setup.py tries to download a prebuilt CUDA wheel).  Such a build
fails at ``import mamba_ssm``: its ``__init__`` imports ``selective_scan_cuda`` unconditionally,
and megatron.core.ssm.mamba_mixer then records ``HAVE_MAMBA_SSM = False`` for good.

``install_stub`` (the patch register's ``mamba_ssm_stub``) registers a stand-in module in
``sys.modules``.  It keeps Python's module protocol: it defines exactly what mamba_ssm calls,
``fwd`` and ``bwd`` (``mamba_ssm/ops/selective_scan_interface.py``), each raising RuntimeError
when called; any other attribute is an AttributeError, as for every module.  (An earlier stub
answered every lookup with ImportError; pickle's module search - which inductor's cache key runs
for ``torch.contiguous_format`` - treats only AttributeError as "not here", so every
``torch.compile`` in the process failed.)  The worker installs it only in ranks that build a
hybrid model, before anything imports ``megatron.core.ssm`` (ModelOpt's importer does).
Where the real extension is installed nothing is changed.
"""
from __future__ import annotations

import importlib.util
import sys
import types

EXTENSION = "selective_scan_cuda"
CALLED_BY_MAMBA_SSM = ("fwd", "bwd")
MESSAGE = (f"{EXTENSION}.{{name}}: mamba_ssm was installed without its CUDA extension "
           f"(MAMBA_SKIP_CUDA_BUILD=TRUE); Mamba-1's selective scan is unavailable. Mamba-2 "
           f"(Nemotron-H) uses mamba_ssm's triton kernels and does not need it.")


def _unavailable(name: str):
    def kernel(*args, **kwargs):
        raise RuntimeError(MESSAGE.format(name=name))

    kernel.__name__ = kernel.__qualname__ = name
    kernel.__module__ = EXTENSION
    return kernel


def make_stub() -> types.ModuleType:
    """A plain module with ``fwd``/``bwd`` that raise when called, and nothing else."""
    stub = types.ModuleType(EXTENSION, f"Stand-in for mamba_ssm's {EXTENSION} (launcher.megatron.mamba_ssm_compat).")
    for name in CALLED_BY_MAMBA_SSM:
        setattr(stub, name, _unavailable(name))
    stub.__launcher_stub__ = True
    return stub


def state() -> str:
    """"absent" (no mamba_ssm), "full" (extension present), "stubbed" (stand-in registered) or
    "no-extension" (mamba_ssm installed without it and no stand-in: ``import mamba_ssm`` fails)."""
    if importlib.util.find_spec("mamba_ssm") is None:
        return "absent"
    existing = sys.modules.get(EXTENSION)
    if getattr(existing, "__launcher_stub__", False):
        return "stubbed"
    if existing is not None or importlib.util.find_spec(EXTENSION) is not None:
        return "full"
    return "no-extension"


def importable() -> bool:
    """Can ``import mamba_ssm`` succeed in this process as it stands?"""
    return state() in ("full", "stubbed")


def install_stub(rec) -> bool:
    """The register's ``mamba_ssm_stub``: False (nothing to do) unless mamba_ssm lacks its extension."""
    if state() != "no-extension":
        return False
    rec.set_item(sys.modules, EXTENSION, make_stub())
    return True


def megatron_mamba_status() -> tuple[bool, str]:
    """(usable, reason): can megatron.core.ssm build a MambaMixer in this process?  Applies the
    stub (idempotent) when it is still in time."""
    from launcher.megatron import patches

    if state() == "absent":
        return False, ("the mamba_ssm package is not installed (scripts/setup_venv.sh builds it "
                       "without its CUDA extension; see launcher/megatron/mamba_ssm_compat.py)")
    patches.apply("mamba_ssm_stub")
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
        return False, ("megatron.core.ssm.mamba_mixer was imported before the mamba_ssm stub was "
                       "installed; hybrid ranks install it first (init_distributed(architecture=...))")
    return True, f"mamba_ssm {state()}"
