"""benchmarks/nano_width.py's model: widths read from the Nano card (not copied), the pattern cut
as asked, and the parameter counts the report's throughput and MFU are computed from."""
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("nano_width", ROOT / "benchmarks" / "nano_width.py")
nw = importlib.util.module_from_spec(spec)
spec.loader.exec_module(nw)
CARD = nw.read_card()


def test_patterns_are_the_cards_prefix_or_a_valid_pattern():
    assert nw.resolve_pattern("13", CARD["hybrid_override_pattern"]) == CARD["hybrid_override_pattern"][:13]
    assert nw.resolve_pattern("MEM*E", CARD["hybrid_override_pattern"]) == "MEM*E"
    with pytest.raises(ValueError, match=r"--patterns: 'MEX' has \['X'\]; valid layer letters: M \(Mamba-2\)"):
        nw.resolve_pattern("MEX", CARD["hybrid_override_pattern"])
    with pytest.raises(ValueError, match="--patterns: 53 layers asked, the card's pattern has 52"):
        nw.resolve_pattern("53", CARD["hybrid_override_pattern"])


@pytest.mark.torch
def test_model_has_the_cards_widths_and_counts_its_experts():
    import torch
    import transformers

    class Tok:
        bos_token_id, eos_token_id, pad_token_id = 1, 2, 2

    config = nw.nano_config(CARD, "MEM*E", 151680, Tok())
    for key in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "mamba_num_heads",
                "mamba_head_dim", "n_groups", "ssm_state_size", "n_routed_experts", "num_experts_per_tok",
                "moe_intermediate_size", "moe_shared_expert_intermediate_size", "tie_word_embeddings"):
        assert getattr(config, key) == CARD[key], key
    assert config.num_hidden_layers == 5 and config.vocab_size == 151680
    with torch.device("meta"):
        model = transformers.NemotronHForCausalLM(config)
    counts = nw.param_counts(model, CARD["num_experts_per_tok"], CARD["n_routed_experts"])
    # two E layers, each 128 relu2 experts of an up and a down projection
    experts = 2 * CARD["n_routed_experts"] * 2 * CARD["hidden_size"] * CARD["moe_intermediate_size"]
    assert counts["routed_experts"] == experts
    assert counts["embedding"] == 151680 * CARD["hidden_size"]
    assert counts["active_non_embedding"] == counts["total"] - counts["embedding"] - experts + experts * 6 // 128
