"""Every workaround that lets Megatron-Core + ModelOpt run on a CPU-only torch (gloo ranks).

Megatron-Core 0.19 and ModelOpt 0.47 assume CUDA in a handful of places.  This module patches
exactly those places, and nothing else, so that the tiny-model pipeline runs on CPU with real
megatron-core code.  Each shim is an entry of the patch register (``launcher.megatron.patches``,
named ``cpu_<shim>``: reason, condition, undo).  ``apply_cpu_compat()`` applies them all; it is
idempotent and refuses (``PatchRefused``, a RuntimeError: exit 5) in a process that can see CUDA,
because replacing ``torch.cuda.*`` there would silently break the real CUDA paths.

Each shim, and what breaks without it (megatron-core 0.19.2, modelopt 0.47.0; established by the
CPU probes; each shim's test in tests/ shows the failure):

``current_device``
    ``torch.cuda.current_device()`` returns ``"cpu"``; ``torch.cuda.synchronize`` is a no-op.
    Megatron uses ``device=torch.cuda.current_device()`` when it allocates tensors (RoPE's
    ``inv_freq``, MoE routing buffers): without it, "Torch not compiled with CUDA enabled".
``streams``
    Fake ``torch.cuda.Stream`` / ``current_stream`` / ``stream``.  The alltoall token
    dispatcher creates a side stream in ``__init__``: without it, construction fails.
``alltoall_split_sizes``
    ``token_dispatcher.maybe_move_tensor_to_cpu`` also converts CPU tensors (Megatron only
    converts CUDA ones).  The alltoall dispatcher passes the split sizes to
    ``all_to_all_single``; gloo needs them as lists/numpy, a CPU tensor raises TypeError.
``pipeline_schedules``
    ``schedules.torch.zeros(..., device="cuda")`` is redirected to CPU.  The forward-only
    pipeline schedules allocate ``total_num_tokens`` on CUDA: without it, every schedule call
    fails, PP=1 included.
``nvfp4_dynamic_block_quant``
    ModelOpt's NVFP4 fake quantization (dynamic block quant, E2M1 values with E4M3 block scales)
    only has CUDA implementations (triton kernel / cuda_ext_mx; "amax must be a CUDA tensor for
    dynamic block quantization").  CPU tensors get ModelOpt's own arithmetic: the reference is
    ``NVFP4QTensor.quantize`` / ``dequantize`` (the code its export uses to pack the weights,
    ``nvfp4_fake_quant_reference``); ``nvfp4_fake_quant_cpu`` computes the same values without
    the E2M1 codes and their nibble packing (the rounding done as ``round(t / step) * step``,
    ties to even, with the E2M1 spacing of ``t``'s binade), equal to the reference bit for bit
    (tests/test_nvfp4_cpu.py; ``benchmarks/nvfp4_fake_quant.py`` times both).  Inputs the fast
    path does not cover (a NaN or zero scale, a last dim that is not whole blocks) go to the
    reference.  tests/test_gpu_quantize.py compares the CPU path with the GPU kernel.
``tied_embeddings_pp``
    ``LanguageModule.setup_embeddings_and_output_layer`` copies the tied word embeddings from
    the first to the last pipeline stage with ``weight.data = weight.data.cuda()`` then an
    all-reduce over the embedding group: at PP>1 with ``tie_word_embeddings`` (Llama-3.2,
    SmolLM2, dense Qwen3) every rank fails in ``GPTModel.__init__`` with "Torch not compiled
    with CUDA enabled".  On CPU the original runs with that block skipped, then the same
    all-reduce runs on the CPU tensor.
``mamba_reference_kernels``
    Megatron's Mamba mixer calls mamba_ssm's triton kernels for the Mamba-2 chunked scan
    (``mamba_chunk_scan_combined``) and the gated RMSNorm (``layernorm_gated.rmsnorm_fn``); triton
    has no CPU backend ("0 active drivers").  CPU tensors are routed through mamba_ssm's own
    pure-torch references (``ssd_chunk_scan_combined_ref``, ``rms_norm_ref``), with the sequence
    zero-padded to a whole number of chunks (the reference needs it; the scan is causal, so the
    padding changes nothing before it) and cut back after.  Only the arguments the mixer's
    prefill path passes are supported; anything else raises.  Skipped when mamba_ssm is not
    installed (no hybrid model can be built then).

``seed_megatron_rng_cpu`` (not a patch; ``launcher.megatron.dist`` calls it on CPU)
    Seeds Megatron's model-parallel RNG tracker with
    ``model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True, force_reset_rng=True)``.
    The default tracker snapshots ``torch.cuda`` RNG states and fails without CUDA; the
    inference tracker's fork/add are no-ops (fine: no dropout, weights come from checkpoints).
"""
from __future__ import annotations

import contextlib
import types


class _CpuStream:
    """Stands in for ``torch.cuda.Stream``: every operation is a synchronous no-op on CPU."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def record_event(self, *args, **kwargs):
        return _CpuEvent()

    def __eq__(self, other):
        return isinstance(other, _CpuStream)

    def __hash__(self):
        return 0


class _CpuEvent:
    def synchronize(self):
        pass

    def wait(self, *args, **kwargs):
        pass

    def record(self, *args, **kwargs):
        pass


def patch_current_device(rec) -> None:
    import torch

    rec.set(torch.cuda, "current_device", lambda: "cpu")
    rec.set(torch.cuda, "synchronize", lambda *args, **kwargs: None)


def patch_streams(rec) -> None:
    import torch

    rec.set(torch.cuda, "Stream", _CpuStream)
    rec.set(torch.cuda, "current_stream", lambda *args, **kwargs: _CpuStream())
    rec.set(torch.cuda, "stream", lambda stream=None: contextlib.nullcontext())


def patch_alltoall_split_sizes(rec) -> None:
    import torch
    import megatron.core.transformer.moe.token_dispatcher as token_dispatcher

    def to_host(tensor, as_numpy: bool = False, record_stream: bool = False):
        if torch.is_tensor(tensor):
            tensor = tensor.cpu()
            if as_numpy:
                tensor = tensor.numpy()
        return tensor

    rec.set(token_dispatcher, "maybe_move_tensor_to_cpu", to_host)


def patch_pipeline_schedules(rec) -> None:
    import torch
    import megatron.core.pipeline_parallel.schedules as schedules

    class _TorchOnCpu(types.ModuleType):
        """``torch`` as seen by schedules.py, with CUDA allocations moved to CPU."""

        def __getattr__(self, name):
            return getattr(torch, name)

        @staticmethod
        def zeros(*args, **kwargs):
            if str(kwargs.get("device", "")).startswith("cuda"):
                kwargs["device"] = "cpu"
            return torch.zeros(*args, **kwargs)

    rec.set(schedules, "torch", _TorchOnCpu("torch"))


def patch_nvfp4_dynamic_block_quant(rec) -> None:
    import modelopt.torch.quantization.tensor_quant as tensor_quant

    cuda_impl = tensor_quant.dynamic_block_quantize_op

    def dynamic_block_quantize(inputs, block_size, amax, num_bits, exponent_bits,
                               scale_num_bits, scale_exponent_bits):
        is_nvfp4 = (num_bits, exponent_bits, scale_num_bits, scale_exponent_bits) == (4, 2, 8, 4)
        if inputs.is_cuda or not is_nvfp4:
            return cuda_impl(inputs, block_size, amax, num_bits, exponent_bits,
                             scale_num_bits, scale_exponent_bits)
        return nvfp4_fake_quant_cpu(inputs, block_size, amax)

    rec.set(tensor_quant, "dynamic_block_quantize_op", dynamic_block_quantize)


E2M1_MAX, E4M3_MAX = 6.0, 448.0
_E4M3_MIN_SCALE = 2.0 ** -9      # ModelOpt clamps block scales to [2**-9, 448] before the FP8 cast
_FLOAT32_EXPONENT_BITS = 0x7F800000


def nvfp4_fake_quant_reference(inputs, block_size: int, amax=None):
    """NVFP4 quantize-dequantize of ``inputs`` along its last dim with ModelOpt's NVFP4QTensor.

    ``amax`` is the per-tensor amax (the second-level scale is amax / (6 * 448)); None means the
    tensor's own amax, as the GPU kernels do for dynamic quantizers.
    """
    import torch
    from modelopt.torch.quantization.qtensor import NVFP4QTensor

    x = inputs.float()
    global_amax = x.abs().amax() if amax is None else amax.float().amax()
    scale_2 = global_amax / (E2M1_MAX * E4M3_MAX)
    packed, scale, scale_2 = NVFP4QTensor.quantize(x, block_size, weights_scaling_factor_2=scale_2)
    out = packed.dequantize(dtype=torch.float32, scale=scale, double_scale=scale_2,
                            block_sizes={-1: block_size})
    return out.reshape(inputs.shape).to(inputs.dtype)


def nvfp4_fake_quant_cpu(inputs, block_size: int, amax=None):
    """``nvfp4_fake_quant_reference``'s values, bit for bit, without E2M1 codes.

    The same block scales (``max(|max|, |min|)`` per block over ``6 * scale_2``, zero made 1,
    clamped to [2**-9, 448] and cast to E4M3) and the same division ``t = x / s``; then, instead of
    E2M1 codes packed into nibbles and looked up again, ``round(t / step) * step`` clamped to +-6,
    where ``step`` is E2M1's spacing in ``t``'s binade (0.5 below 2, 1 below 4, 2 above: the
    exponent bits of ``t`` halved, clamped to [0.5, 2]).  Every step is a power of two, so dividing
    and multiplying by it are exact, and ``round`` breaks ties to the even value, as ModelOpt's
    ``searchsorted`` + odd-bound test does.  The product with ``s`` is taken as ``0 + q * s``,
    which turns a rounded -0 into the +0 of ModelOpt's code table.
    """
    import torch

    x = inputs.float()
    global_amax = x.abs().amax() if amax is None else amax.float().amax()
    scale_2 = global_amax / (E2M1_MAX * E4M3_MAX)
    if x.shape[-1] % block_size or not bool(torch.isfinite(scale_2) & (scale_2 > 0)):
        return nvfp4_fake_quant_reference(inputs, block_size, amax)
    blocks = x.reshape(*x.shape[:-1], x.shape[-1] // block_size, block_size)
    block_amax = torch.maximum(blocks.amax(dim=-1).abs(), blocks.amin(dim=-1).abs())
    block_scale = block_amax / (E2M1_MAX * scale_2)
    block_scale[block_scale == 0] = 1.0
    block_scale = block_scale.clamp(min=_E4M3_MIN_SCALE, max=E4M3_MAX).to(torch.float8_e4m3fn).float()
    if bool(block_scale.isnan().any()):     # a NaN in the input: the reference's NaNs, sign bits included
        return nvfp4_fake_quant_reference(inputs, block_size, amax)
    s = (block_scale * scale_2).unsqueeze(-1)
    t = blocks / s
    step = (t.view(torch.int32) & _FLOAT32_EXPONENT_BITS).view(torch.float32)
    step.mul_(0.5).clamp_(0.5, 2.0)
    q = t.div_(step).round_().mul_(step).clamp_(-E2M1_MAX, E2M1_MAX)
    out = torch.addcmul(torch.zeros((), dtype=torch.float32), q, s)
    return out.reshape(inputs.shape).to(inputs.dtype)


def patch_tied_embeddings_pp(rec) -> None:
    import torch
    from megatron.core.models.common.language_module.language_module import LanguageModule

    original = LanguageModule.setup_embeddings_and_output_layer

    def setup_embeddings_and_output_layer(self) -> None:
        cfg = self.config
        if cfg.init_model_with_meta_device or not torch.distributed.is_initialized():
            return original(self)
        cfg.init_model_with_meta_device = True   # skips only the .cuda() + all-reduce block
        try:
            original(self)
        finally:
            cfg.init_model_with_meta_device = False
        if (self.share_embeddings_and_output_weights or getattr(cfg, "mtp_num_layers", 0)) \
                and cfg.pipeline_model_parallel_size > 1 and self._is_in_embd_group():
            torch.distributed.all_reduce(self.shared_embedding_or_output_weight().data, group=self.embd_group)

    setup_embeddings_and_output_layer.__wrapped__ = original
    rec.set(LanguageModule, "setup_embeddings_and_output_layer", setup_embeddings_and_output_layer)


def patch_mamba_reference_kernels(rec) -> bool:
    from launcher.megatron.mamba_ssm_compat import importable

    if not importable():   # mamba_ssm absent, or without its extension in a rank that is not hybrid
        return False
    import megatron.core.ssm.mamba_mixer as mixer

    if not mixer.HAVE_MAMBA_SSM:
        return False
    import torch.nn.functional as F
    from mamba_ssm.ops.triton import layernorm_gated
    from mamba_ssm.ops.triton.ssd_combined import ssd_chunk_scan_combined_ref

    scan_kernel = mixer.mamba_chunk_scan_combined
    norm_kernel = layernorm_gated.rmsnorm_fn

    def chunk_scan(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None,
                   seq_idx=None, cu_seqlens=None, dt_softplus=False, dt_limit=(0.0, float("inf")),
                   return_final_states=False, return_varlen_states=False, **kwargs):
        if x.is_cuda:
            return scan_kernel(x, dt, A, B, C, chunk_size, D=D, z=z, dt_bias=dt_bias,
                               initial_states=initial_states, seq_idx=seq_idx, cu_seqlens=cu_seqlens,
                               dt_softplus=dt_softplus, dt_limit=dt_limit,
                               return_final_states=return_final_states,
                               return_varlen_states=return_varlen_states, **kwargs)
        unsupported = {"initial_states": initial_states is not None, "seq_idx": seq_idx is not None,
                       "cu_seqlens": cu_seqlens is not None, "return_final_states": return_final_states,
                       "return_varlen_states": return_varlen_states,
                       "dt_limit": tuple(dt_limit) != (0.0, float("inf")), **{k: True for k in kwargs}}
        if any(unsupported.values()):
            raise NotImplementedError(f"CPU Mamba scan (reference kernel) does not support "
                                      f"{sorted(k for k, v in unsupported.items() if v)}")
        seqlen = x.shape[1]
        pad = (-seqlen) % chunk_size

        def padded(t):
            return None if t is None or not pad else F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad))

        if pad:
            x, dt, B, C, z = padded(x), padded(dt), padded(B), padded(C), padded(z)
        out = ssd_chunk_scan_combined_ref(x, dt, A, B, C, chunk_size, D=D, z=z, dt_bias=dt_bias,
                                          dt_softplus=dt_softplus)
        return out[:, :seqlen]

    def rmsnorm_fn(x, weight, bias, z=None, eps=1e-6, group_size=None, norm_before_gate=True):
        if x.is_cuda:
            return norm_kernel(x, weight, bias, z=z, eps=eps, group_size=group_size,
                               norm_before_gate=norm_before_gate)
        return layernorm_gated.rms_norm_ref(x, weight, bias, z=z, eps=eps, group_size=group_size,
                                            norm_before_gate=norm_before_gate)

    rec.set(mixer, "mamba_chunk_scan_combined", chunk_scan)
    rec.set(layernorm_gated, "rmsnorm_fn", rmsnorm_fn)
    return True


def apply_cpu_compat() -> list[str]:
    """Apply every CPU shim of the patch register once (idempotent); returns the names applied.

    Raises ``PatchRefused`` (RuntimeError) where CUDA is visible (``init_distributed`` calls this
    only for device "cpu", whose ranks are started with ``CUDA_VISIBLE_DEVICES=``).
    """
    from launcher.megatron import patches

    return patches.apply_all(patches.cpu_patches())


def seed_megatron_rng_cpu(seed: int) -> None:
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True, force_reset_rng=True)
