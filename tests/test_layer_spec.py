"""``build_model(layer_spec=...)``: the local spec everywhere; Megatron's TransformerEngine spec only
where it can run (a GPT architecture, on CUDA, with transformer_engine_torch importable), for the GPU
trial scripts/te_trial.py. The refusals, in full, on a machine without TE."""
from __future__ import annotations

import importlib.util

import pytest

from launcher.architectures import ARCHITECTURES
from launcher.megatron.models import LAYER_SPECS, TE_SPEC_REFUSAL, check_layer_spec

QWEN = ARCHITECTURES["Qwen3MoeForCausalLM"]
NEMOTRON_H = ARCHITECTURES["NemotronHForCausalLM"]


def test_the_local_spec_builds_every_architecture_on_every_device():
    assert LAYER_SPECS == ("local", "te")
    for arch in ARCHITECTURES.values():
        for device in ("cpu", "cuda"):
            check_layer_spec("local", arch, device)


def test_an_unknown_spec_names_the_valid_ones():
    with pytest.raises(ValueError) as e:
        check_layer_spec("transformer_engine", QWEN, "cuda")
    assert str(e.value) == "layer_spec='transformer_engine' is not valid; valid values: ['local', 'te']"


def test_the_te_spec_of_the_hybrid_model_is_refused_with_the_reason():
    with pytest.raises(ValueError) as e:
        check_layer_spec("te", NEMOTRON_H, "cuda")
    assert str(e.value) == TE_SPEC_REFUSAL


def test_the_te_spec_needs_cuda():
    with pytest.raises(ValueError) as e:
        check_layer_spec("te", QWEN, "cpu")
    assert str(e.value) == ("layer_spec='te' needs device='cuda' (TransformerEngine's modules run on "
                            "NVIDIA GPUs only), not 'cpu'")


@pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is not None,
                    reason="TransformerEngine is installed here")
def test_the_te_spec_without_transformer_engine_says_what_is_missing():
    with pytest.raises(ValueError) as e:
        check_layer_spec("te", QWEN, "cuda")
    assert str(e.value).startswith("layer_spec='te' needs TransformerEngine's PyTorch package "
                                   "(transformer_engine_torch): ModuleNotFoundError: No module named "
                                   "'transformer_engine'"), str(e.value)
