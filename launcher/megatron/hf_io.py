"""HF checkpoint <-> Megatron-Core weights through ModelOpt's unified import/export.

Export is correct only at TP=1 and EP=1 (ModelOpt 0.47 writes empty tensors at TP>1 and lets
EP ranks overwrite each other's experts at EP>1): ``export_hf`` refuses
other layouts.  After ModelOpt writes the checkpoint, the per-shard sidecar
``model-XXXXX-of-YYYYY.json`` files it leaves are deleted (not part of an HF checkpoint) and the tokenizer
files of the source checkpoint are copied in, so the export directory is a servable checkpoint.
"""
from __future__ import annotations

import os
import re
import shutil

from launcher.megatron.modelopt_fixes import apply_modelopt_fixes
from launcher.megatron.models import resolve_dtype, unwrap_model

TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json",
    "generation_config.json",
)
_SIDECAR = re.compile(r"^model-\d{5}-of-\d{5}\.json$")


def import_hf_weights(model, hf_path: str, dtype="bfloat16") -> None:
    """Load the HF safetensors at ``hf_path`` into this rank's shard of ``model`` (all ranks call)."""
    from modelopt.torch.export import import_mcore_gpt_from_hf

    apply_modelopt_fixes()
    device = "cuda" if next(model.parameters()).is_cuda else "cpu"
    import_mcore_gpt_from_hf(unwrap_model(model), hf_path, dtype=resolve_dtype(dtype, device))


def _check_export_layout() -> None:
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    ep = ps.get_expert_model_parallel_world_size()
    etp = ps.get_expert_tensor_parallel_world_size()
    if (tp, ep, etp) != (1, 1, 1):
        raise ValueError(
            f"export needs tp=1, ep=1, etp=1 (got tp={tp}, ep={ep}, etp={etp}): ModelOpt's export "
            "writes empty tensors at TP>1 and drops experts at EP>1; reload the checkpoint at "
            "tp=1 ep=1 (any pp) and export from there")


def export_hf(model, hf_path: str, export_dir: str, dtype="bfloat16") -> list[str]:
    """Write ``model`` as an HF (unified, quantized if applicable) checkpoint into ``export_dir``.

    All ranks call.  ``hf_path`` is the source checkpoint (its config.json is the template).
    Returns the sorted file names of the export (on every rank, after a barrier).
    """
    import torch.distributed as dist
    from modelopt.torch.export import export_mcore_gpt_to_hf

    _check_export_layout()
    apply_modelopt_fixes()
    rank = dist.get_rank()
    if rank == 0:
        os.makedirs(export_dir, exist_ok=True)
    dist.barrier()
    device = "cuda" if next(model.parameters()).is_cuda else "cpu"
    export_mcore_gpt_to_hf(unwrap_model(model), hf_path, dtype=resolve_dtype(dtype, device),
                           export_dir=export_dir)
    dist.barrier()
    if rank == 0:
        remove_sidecar_files(export_dir)
        copy_tokenizer_files(hf_path, export_dir)
        exclude_tied_lm_head(export_dir)
    dist.barrier()
    return sorted(os.listdir(export_dir))


def remove_sidecar_files(export_dir: str) -> list[str]:
    """Delete ModelOpt's per-shard ``model-XXXXX-of-YYYYY.json`` metadata files; return their names."""
    removed = []
    for name in sorted(os.listdir(export_dir)):
        if _SIDECAR.match(name):
            os.remove(os.path.join(export_dir, name))
            removed.append(name)
    return removed


def exclude_tied_lm_head(export_dir: str) -> bool:
    """Name ``lm_head`` in the export's exclude list when the output layer is tied to the embeddings.

    A tied model has no output layer of its own in Megatron, so ModelOpt lists only the embedding
    (``model.embed_tokens``) as unquantized.  vLLM builds ``lm_head`` as a layer of its own and
    quantizes every layer the list does not name: it then waits for NVFP4 scales the checkpoint
    cannot hold ("NVFP4 weight_scale for layer 'parallel_lm_head' was never loaded").  The output
    layer is the embedding, unquantized, so it belongs in the list.  Both copies of the list are
    updated (hf_quant_config.json ``exclude_modules``, config.json ``quantization_config.ignore``).
    Returns whether anything was added.
    """
    import fnmatch
    import json

    from launcher.hf_config import tied_embeddings

    config_path = os.path.join(export_dir, "config.json")
    hqc_path = os.path.join(export_dir, "hf_quant_config.json")
    if not (os.path.isfile(config_path) and os.path.isfile(hqc_path)):
        return False
    with open(config_path) as f:
        config = json.load(f)
    if not tied_embeddings(config):
        return False
    with open(hqc_path) as f:
        hqc = json.load(f)
    excludes = hqc.setdefault("quantization", {}).setdefault("exclude_modules", [])
    if any(fnmatch.fnmatchcase("lm_head", p) for p in excludes):
        return False
    excludes.append("lm_head")
    quant_config = config.get("quantization_config")
    if isinstance(quant_config, dict):
        ignore = quant_config.setdefault("ignore", [])
        if "lm_head" not in ignore:
            ignore.append("lm_head")
    for path, data in ((hqc_path, hqc), (config_path, config)):
        with open(path + ".tmp", "w") as f:
            json.dump(data, f, indent=4)
        os.replace(path + ".tmp", path)
    return True


def copy_tokenizer_files(hf_path: str, export_dir: str) -> list[str]:
    """Copy the tokenizer (and generation config) files present in ``hf_path``; return their names."""
    copied = []
    for name in TOKENIZER_FILES:
        src = os.path.join(hf_path, name)
        if os.path.isfile(src) and not os.path.exists(os.path.join(export_dir, name)):
            shutil.copy2(src, os.path.join(export_dir, name))
            copied.append(name)
    return copied
