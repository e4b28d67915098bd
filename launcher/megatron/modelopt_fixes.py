"""Fixes for nvidia-modelopt bugs (every device, not CPU shims), each registered in ``FIXES``.

``fp8_export_single_rounding`` - ModelOpt 0.47's Megatron exporter
(``modelopt.torch.export.unified_export_megatron``) casts each weight to the export dtype
(bf16) and then quantizes it with ``(weight / scale).to(float8_e4m3fn)``.  For per-tensor FP8
the scale is a 0-dim fp32 tensor, and PyTorch's type promotion keeps a dimensioned bf16 tensor
divided by a 0-dim fp32 tensor in bf16: every FP8 code is rounded twice (to bf16, then to FP8).
The fake quantization the MMLU gate evaluated rounds once, from fp32, so about 2-3% of the FP8
codes of a bf16 export come out one step off the weights the gate evaluated (measurements:
benchmarks/README.md, "Measurements behind the export verifier and the FP8 fix";
``pytest -s tests/test_modelopt_fixes.py`` prints the CPU ones).

The exporter does this arithmetic on CPU tensors (``module.weight.to(dtype).cpu()``) whichever
device the model is on, so the CPU tests cover the GPU path.  The fix upcasts the (exact) bf16/fp16
weight to fp32 before the division - the single rounding the fake quant uses.  CPU runs of this
project export in fp32 and were never affected.  ``tests/test_modelopt_fixes.py`` asserts the bug
is still present in the installed ModelOpt, so an upstream fix shows up as a failing test that
says to delete this module.

``nemotron_h_embedding_name`` - ModelOpt 0.47's Nemotron-H import mapping reads the embedding as
``backbone.embeddings.weight`` (the hub's Nemotron-3 checkpoints), but transformers >= 5's
``save_pretrained`` writes ``backbone.embedding.weight`` (its conversion table maps both names
on load; ModelOpt's importer knows one): ``import_mcore_gpt_from_hf`` then fails with "Key
[backbone.embeddings.weight] does not exist!".  The fix makes the importer's tensor lookup try
the other spelling of exactly that key when the first is absent.  ``tests/test_modelopt_fixes.py``
checks the installed ModelOpt still fails without it.

``nvfp4_fast_cast`` - speed, the same bytes.  ModelOpt 0.47 packs each NVFP4 weight to E2M1 codes
on the host (the exporter moves every weight to the CPU first) with ``torch.searchsorted`` over the
7 rounding bounds plus a broadcast test for the ties at the odd bounds.  Profiled on an H100
(benchmarks/results/2026-12-06-h100-nano-width-profile.json): 87 of the Nano-width export's 99 s
of writing, 0.16 s per 5 M-element expert weight.  ``cast_fp4`` computes the same code with 7
comparisons (``>`` at the bounds that round down on a tie, ``>=`` at those that round up: ties to
the even code, as ModelOpt's ``searchsorted`` + odd-bound test does; NaN gives code 7 as
``searchsorted`` sorts it last).  ``tests/test_modelopt_fixes.py`` checks the codes and the
exported files byte for byte against ModelOpt's own; ``benchmarks/export_pack.py`` measures both.

``export_pack_on_gpu`` - speed, the same bytes, CUDA ranks only.  The exporter reads every weight
to the host (``module.weight.to(dtype).cpu()``) and packs it there: on an H100 the Nano-width
export wrote 35 M parameters/s, nearly all of it host arithmetic.  The fix packs on the rank's GPU
instead: ``to_quantized_weight`` gets a host weight, copies it to the current CUDA device, packs
it there with ModelOpt's own code (and the fixes above) and returns the codes to the host, where
the exporter expects them.  The arithmetic is elementwise IEEE division and comparisons, the same
on both devices (the H200 probe, ``gpu_checks.sh probe``: the same bytes for NVFP4 and FP8), and it
is the device the MMLU gate's folded weights are computed on (``exported_weights``).  On a rank
without CUDA the patch has nothing to do and is not applied.  ``tests/test_gpu_quantize.py``
exports one model both ways and compares the files byte for byte.

``te_gated_mlp_extra_state`` - ModelOpt 0.47's HF importer loads a gated MLP's merged fc1 weight
with a strict ``load_state_dict`` and keeps the module's TransformerEngine ``_extra_state`` only when
the module also has a fused LayerNorm weight.  Under Megatron's TE layer spec the MoE experts' fc1
(``TEColumnParallelLinear``, no fused norm) then fails: "Missing key(s) in state_dict:
"_extra_state"" (the H100 TE trial, benchmarks/results/2026-12-07-h100-all-c4aa2e6.json, call 8).  The fix
gives that one load the module's own ``_extra_state`` when the importer's dict lacks it; a module
without extra state (the local spec's linears) loads exactly as before.
``tests/test_modelopt_fixes.py`` runs ModelOpt's own merge on a module with extra state both ways; on an
H100 the TE-spec models then imported and gave the local spec's predictions (scripts/te_trial.py,
benchmarks/results/2026-12-07-h100-te-trial-nano-trained-c8af8cc.json).
"""
from __future__ import annotations

FIXES = ("modelopt_fp8_export_single_rounding", "modelopt_nemotron_h_embedding_name",
         "modelopt_nvfp4_fast_cast", "modelopt_export_pack_on_gpu",
         "modelopt_te_gated_mlp_extra_state")   # patch register names


def fp8_export_single_rounding(rec) -> None:
    import torch
    import modelopt.torch.export.unified_export_megatron as exporter
    from modelopt.torch.export.model_config import QUANTIZATION_FP8

    original = exporter.to_quantized_weight

    def to_quantized_weight(weight, weights_scaling_factor, quantization, *args, **kwargs):
        if (quantization == QUANTIZATION_FP8 and weights_scaling_factor is not None
                and weights_scaling_factor.dim() == 0 and weight.dtype in (torch.bfloat16, torch.float16)):
            weight = weight.float()
        return original(weight, weights_scaling_factor, quantization, *args, **kwargs)

    to_quantized_weight.__wrapped__ = original
    rec.set(exporter, "to_quantized_weight", to_quantized_weight)


# key ModelOpt asks for -> the other spellings a checkpoint may use for it
TENSOR_NAME_ALIASES = {"backbone.embeddings.weight": ("backbone.embedding.weight",)}


def nemotron_h_embedding_name(rec) -> None:
    import modelopt.torch.export.plugins.megatron_importer as importer

    original = importer.get_safetensor

    def get_safetensor(pretrained_model_path, key, *args, **kwargs):
        try:
            return original(pretrained_model_path, key, *args, **kwargs)
        except ValueError:
            for alias in TENSOR_NAME_ALIASES.get(key, ()):
                try:
                    return original(pretrained_model_path, alias, *args, **kwargs)
                except ValueError:
                    continue
            raise

    get_safetensor.__wrapped__ = original
    rec.set(importer, "get_safetensor", get_safetensor)


E2M1_BOUNDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)   # midpoints of 0, .5, 1, 1.5, 2, 3, 4, 6
_TIES_ROUND_UP = (False, True, False, True, False, True, False)   # to the even code: at .75, 1.75, 3.5


def cast_fp4(weight):
    """E2M1 codes (uint8, sign in bit 3) of an already scaled ``weight``: ModelOpt 0.47's
    ``NVFP4QTensor._cast_fp4`` without its bucket search (the same codes; ``weight`` is made
    absolute in place, as ModelOpt's does)."""
    import torch

    sign = (weight < 0).to(torch.uint8) << 3
    magnitude = weight.abs_()
    code = torch.zeros_like(magnitude, dtype=torch.uint8)
    for bound, up in zip(E2M1_BOUNDS, _TIES_ROUND_UP):
        code += (magnitude >= bound) if up else (magnitude > bound)
    code.masked_fill_(magnitude.isnan(), len(E2M1_BOUNDS))
    return sign + code


def nvfp4_fast_cast(rec) -> None:
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

    original = NVFP4QTensor.__dict__["_cast_fp4"]

    def _cast_fp4(cls, weight):
        return cast_fp4(weight)

    _cast_fp4.__wrapped__ = original
    rec.set(NVFP4QTensor, "_cast_fp4", classmethod(_cast_fp4))


def pack_on(device, original):
    """``to_quantized_weight`` that packs a host weight on ``device`` and returns host codes; a weight
    already on a device (the gate's fold) or already packed (ModelOpt's ``QTensorWrapper``) goes to
    ``original`` as it is."""
    import torch

    def to_quantized_weight(weight, *args, **kwargs):
        if type(weight) is not torch.Tensor or weight.device.type != "cpu":   # QTensorWrapper: a Parameter
            return original(weight, *args, **kwargs)
        packed = original(weight.to(device), *args, **kwargs)
        return packed.cpu() if isinstance(packed, torch.Tensor) else packed

    to_quantized_weight.__wrapped__ = original
    return to_quantized_weight


def export_pack_on_gpu(rec) -> bool:
    import torch

    if not torch.cuda.is_available():
        return False    # a CPU rank: the exporter's host arithmetic is all there is
    import modelopt.torch.export.unified_export_megatron as exporter

    # "cuda": the current device when each weight is packed (the rank's, set by init_distributed)
    rec.set(exporter, "to_quantized_weight", pack_on(torch.device("cuda"), exporter.to_quantized_weight))
    return True


def keeping_extra_state(merge):
    """``GPTModelImporter._gated_mlp_merging`` whose one ``load_state_dict`` keeps the module's own
    ``_extra_state`` where the merged dict lacks it (TE linears without a fused norm)."""
    def _gated_mlp_merging(self, module, *args, **kwargs):
        import torch

        # torch puts ``_extra_state`` in a module's state dict exactly where its class overrides this
        if type(module).get_extra_state is torch.nn.Module.get_extra_state:
            return merge(self, module, *args, **kwargs)
        own = module.get_extra_state()
        load = module.load_state_dict

        def load_state_dict(state_dict, *a, **k):
            if "_extra_state" not in state_dict:
                state_dict = {**state_dict, "_extra_state": own}
            return load(state_dict, *a, **k)

        module.load_state_dict = load_state_dict    # this call only: the instance attribute goes after
        try:
            return merge(self, module, *args, **kwargs)
        finally:
            del module.load_state_dict

    return _gated_mlp_merging


def te_gated_mlp_extra_state(rec) -> None:
    from modelopt.torch.export.plugins.megatron_importer import GPTModelImporter

    rec.set(GPTModelImporter, "_gated_mlp_merging", keeping_extra_state(GPTModelImporter._gated_mlp_merging))


def apply_modelopt_fixes() -> list[str]:
    """Apply every fix once through the patch register (idempotent); returns the names applied."""
    from launcher.megatron import patches

    return patches.apply_all(FIXES)
