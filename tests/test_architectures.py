"""launcher/architectures.py: the one table of supported HF architectures, and its readers (no torch)."""
import json
import os

import pytest

from conftest import ROOT
from launcher import architectures as A
from launcher.contract import Dispatcher, Dtype, values


def test_table_entries_use_the_schema_vocabulary():
    assert A.SUPPORTED == ("Qwen3MoeForCausalLM", "Qwen3ForCausalLM", "LlamaForCausalLM", "NemotronHForCausalLM")
    assert A.HYBRID == ("NemotronHForCausalLM",)
    for name, a in A.ARCHITECTURES.items():
        assert a.name == name and a.builder in A.BUILDERS
        assert set(a.dtypes) <= set(values(Dtype)) and a.dtypes
        assert set(a.dispatchers) <= set(values(Dispatcher)) and a.dispatchers
        assert (a.max_tp is None) == (not a.tp_reason)
        assert a.gpu_only is None   # every supported architecture runs on this CPU machine (gloo)


def test_lookup_refuses_an_unknown_name_naming_the_supported_ones():
    assert A.architecture("LlamaForCausalLM").builder == "gpt"
    with pytest.raises(ValueError) as e:
        A.architecture("MixtralForCausalLM")
    assert str(e.value) == ("architecture 'MixtralForCausalLM' is not supported; supported: "
                            "['Qwen3MoeForCausalLM', 'Qwen3ForCausalLM', 'LlamaForCausalLM', 'NemotronHForCausalLM']")
    assert A.is_hybrid("NemotronHForCausalLM") and not A.is_hybrid("LlamaForCausalLM")
    assert not A.is_hybrid("MixtralForCausalLM") and not A.is_hybrid(None)


def test_tp_rule():
    assert A.tp_problem("NemotronHForCausalLM", 1) is None
    assert A.tp_problem("NemotronHForCausalLM", 2).startswith(
        "must be 1 for NemotronHForCausalLM: ModelOpt 0.47's Nemotron-H import replicates")
    assert A.tp_problem("Qwen3MoeForCausalLM", 8) is None
    assert A.tp_problem("MixtralForCausalLM", 8) is None   # reported as an unsupported architecture instead


def test_card_derivation_reads_the_hybrid_flag():
    from launcher.config.hf_card import card_from_hf_config

    hf = {"architectures": ["NemotronHForCausalLM"], "hybrid_override_pattern": "M*E", "hidden_size": 8,
          "num_attention_heads": 2, "n_routed_experts": 4, "num_experts_per_tok": 2}
    card = card_from_hf_config(hf)
    assert card["hybrid_pattern"] == "M*E" and card["num_layers"] == 3
    dense = card_from_hf_config({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2, "hidden_size": 8,
                                 "num_attention_heads": 2})
    assert "hybrid_pattern" not in dense


def test_suite_runs_nemotron_h_on_a_cpu_machine(tmp_path):
    """Nemotron-H runs on gloo (Mamba's reference kernels): the suite does not skip it for want of a GPU."""
    from launcher.config.compose import compose_example
    from launcher.suite import why_not_runnable

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["NemotronHForCausalLM"]}))
    cfg = compose_example(os.path.join(ROOT, "examples/tiny/NemotronH-MoE-tiny/megatron_lm_ptq.yaml"),
                          [f"model.path={tmp_path}"])
    reason = why_not_runnable(cfg, gpus=0)
    assert reason is None or "GPU" not in reason, reason
