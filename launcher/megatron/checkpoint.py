"""Megatron distributed checkpoint + ModelOpt state, saved atomically, loadable at any degrees.

Layout of a checkpoint directory::

    <path>/modelopt_state/        ModelOpt's sharded state (quantizer config, amax) when converted
    <path>/*.distcp, metadata ... megatron.core.dist_checkpointing (torch_dist) weights + buffers
    <path>/launcher_checkpoint.json   layout it was saved at, whether ModelOpt state is present

All ranks write into ``<path>.tmp-partial``; after a barrier rank 0 renames it to ``<path>``, so
no partial checkpoint ever sits at the final path.  Note: dist_checkpointing's writer starts a
multiprocessing Manager that re-imports ``__main__``: entry scripts need the
``if __name__ == "__main__":`` guard or saving hangs.
"""
from __future__ import annotations

import json
import os
import shutil

from launcher.megatron.collectives import broadcast
from launcher.megatron.models import unwrap_model

MARKER = "launcher_checkpoint.json"
MODELOPT_STATE_DIR = "modelopt_state"


def _layout() -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    return {
        "world_size": dist.get_world_size(),
        "tp": ps.get_tensor_model_parallel_world_size(),
        "pp": ps.get_pipeline_model_parallel_world_size(),
        "ep": ps.get_expert_model_parallel_world_size(),
        "etp": ps.get_expert_tensor_parallel_world_size(),
        "cp": ps.get_context_parallel_world_size(),
    }


def save_checkpoint(model, path: str, overwrite: bool = False) -> None:
    """Save ``model`` (weights + ModelOpt state) to ``path``. All ranks call; the path must be shared."""
    import modelopt.torch.opt as mto
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from modelopt.torch.opt.plugins.mcore_dist_checkpointing import save_sharded_modelopt_state

    path = os.path.abspath(path)
    exists = broadcast(os.path.exists(path))
    if exists and not overwrite:
        raise ValueError(f"checkpoint path {path} exists; refusing to overwrite (overwrite=True replaces it)")
    tmp = f"{path}.tmp-partial"
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier()

    inner = unwrap_model(model)
    converted = bool(mto.ModeloptStateManager.is_converted(inner))
    if converted:
        save_sharded_modelopt_state([inner], tmp)
    dist_checkpointing.save(inner.sharded_state_dict(), tmp)
    dist.barrier()
    if dist.get_rank() == 0:
        with open(os.path.join(tmp, MARKER), "w") as f:
            json.dump({"saved_at_layout": _layout(), "modelopt_state": converted}, f, indent=2)
        if os.path.exists(path):
            shutil.rmtree(path)
        os.replace(tmp, path)
    dist.barrier()


def read_marker(path: str) -> dict:
    marker = os.path.join(path, MARKER)
    if not os.path.isfile(marker):
        raise ValueError(f"{path} is not a complete launcher checkpoint (no {MARKER})")
    with open(marker) as f:
        return json.load(f)


def load_checkpoint(model, path: str) -> dict:
    """Restore ModelOpt state, then weights, into ``model`` built at any parallel degrees.

    Only ``_extra_state`` entries may be missing or unexpected (ModelOpt quantizers carry
    ``_extra_state`` that dist checkpoints do not hold); any other mismatch is
    an error.  Returns the checkpoint's marker (the layout it was saved at).
    """
    import modelopt.torch.opt as mto
    from megatron.core import dist_checkpointing
    from modelopt.torch.opt.plugins.mcore_dist_checkpointing import restore_sharded_modelopt_state

    path = os.path.abspath(path)
    marker = read_marker(path)
    inner = unwrap_model(model)
    if marker["modelopt_state"]:
        if mto.ModeloptStateManager.is_converted(inner):
            raise ValueError("load_checkpoint needs a freshly built (unquantized) model; this one is "
                             "already converted by ModelOpt")
        restore_sharded_modelopt_state([inner], path)
    state = dist_checkpointing.load(inner.sharded_state_dict(), path)
    missing, unexpected = inner.load_state_dict(state, strict=False)
    bad = [k for k in list(missing) + list(unexpected) if not k.endswith("_extra_state")]
    if bad:
        raise RuntimeError(f"checkpoint {path} does not match the model: {len(bad)} keys differ, e.g. {bad[:5]}")
    return marker
