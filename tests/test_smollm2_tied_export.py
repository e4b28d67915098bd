"""The export verifier on tied embeddings (launcher/export/verify_layout.check_tied_embeddings):
a tied export holds the embedding once and no lm_head.weight, an untied one both, and the flag
equals the source's.  Small safetensors checkpoints written with numpy (no torch)."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from launcher.export.verify import verify_export

pytestmark = pytest.mark.torch   # imports torch, Megatron or ModelOpt (in-process or in its ranks)


def write_checkpoint(path, tie: bool, tensors: tuple[str, ...]) -> str:
    from safetensors.numpy import save_file

    os.makedirs(path, exist_ok=True)
    shapes = {"model.embed_tokens.weight": (32, 8), "lm_head.weight": (32, 8), "model.norm.weight": (8,),
              "model.layers.0.mlp.down_proj.weight": (8, 16)}
    save_file({n: np.full(shapes[n], 0.5, dtype=np.float32) for n in tensors}, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1, "tie_word_embeddings": tie}, f)
    return str(path)


BODY = ("model.embed_tokens.weight", "model.norm.weight", "model.layers.0.mlp.down_proj.weight")


@pytest.mark.parametrize("tie,extra", [(True, ()), (False, ("lm_head.weight",))])
def test_tied_once_or_untied_twice_passes(tmp_path, tie, extra):
    d = write_checkpoint(tmp_path / "x", tie, BODY + extra)
    report = verify_export(d, "none", source_dir=d)
    assert report["ok"], report["errors"]
    assert report["checks"]["tied_embeddings"] == {"tied": tie, "lm_head_tensors": len(extra), "embedding_tensors": 1}


def test_tied_export_with_an_lm_head_is_refused(tmp_path):
    d = write_checkpoint(tmp_path / "x", True, BODY + ("lm_head.weight",))
    errors = verify_export(d, "none")["errors"]
    assert errors == ["lm_head.weight is in the export but config.json ties the output layer to the embeddings "
                      "(model.embed_tokens.weight): written twice"]


def test_untied_export_without_lm_head_and_a_flag_that_differs_from_the_source_are_refused(tmp_path):
    src = write_checkpoint(tmp_path / "src", True, BODY)
    d = write_checkpoint(tmp_path / "x", False, BODY)
    errors = verify_export(d, "none", source_dir=src)["errors"]
    assert "config.json tie_word_embeddings=False but the source checkpoint says True" in errors
    assert "config.json does not tie the embeddings but the export has no lm_head.weight" in errors
