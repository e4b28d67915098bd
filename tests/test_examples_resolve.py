"""Every example composes and validates (no torch); broken configs fail with precise messages.

Runs in CI with the launcher install alone (hydra-core + omegaconf).
"""
import glob
import json
import os
import subprocess
import sys

import pytest

from launcher.architectures import SUPPORTED as SUPPORTED_ARCHITECTURES
from launcher.config.compose import ConfigError, compose_example
from launcher.config.validate import validate
from launcher.schema import enabled_stages
from launcher.topology import ParallelDims

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = sorted(glob.glob(os.path.join(ROOT, "examples", "**", "*.yaml"), recursive=True))
NANO = os.path.join(ROOT, "examples/nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16/megatron_lm_ptq.yaml")
TINY = os.path.join(ROOT, "examples/tiny/Qwen3-MoE-tiny/megatron_lm_ptq.yaml")


def test_examples_found():
    names = {os.path.relpath(p, ROOT) for p in EXAMPLES}
    assert {
        "examples/nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16/megatron_lm_ptq.yaml",
        "examples/nvidia/NVIDIA-Nemotron-3-Super-120B-A12B-BF16/megatron_lm_ptq.yaml",
        "examples/Qwen/Qwen3-30B-A3B/megatron_lm_ptq.yaml",
        "examples/meta-llama/Llama-3.2-1B-Instruct/megatron_lm_ptq.yaml",
        "examples/tiny/Qwen3-MoE-tiny/megatron_lm_ptq.yaml",
    } <= names


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: os.path.relpath(p, os.path.join(ROOT, "examples")))
def test_example_composes_and_validates(path):
    with open(path) as f:
        head = f.read().split("\n", 3)
    assert head[0].startswith("#") and any("launch " in line for line in head), "examples open with their launch command"
    cfg = compose_example(path, [])
    validate(cfg, check_paths=False)
    card = cfg.model
    assert card.architecture in SUPPORTED_ARCHITECTURES
    for stage in enabled_stages(cfg):
        if stage == "vllm_smoke":
            continue
        d = ParallelDims.from_stage(cfg, stage)
        assert d.world_size % (d.tp * d.cp * d.pp) == 0 and d.world_size % (d.etp * d.ep * d.pp) == 0
        assert card.num_layers % d.pp == 0
        assert card.num_attention_heads % d.tp == 0 and card.num_query_groups % d.tp == 0
        if card.num_experts:
            assert card.num_experts % d.ep == 0
        else:
            assert d.ep == 1
    if cfg.stages.export.enabled:
        assert cfg.stages.export.parallel.tp == 1 and cfg.stages.export.parallel.ep == 1
    if not cfg.stages.vllm_smoke.enabled and "nvidia" in path:
        assert cfg.stages.vllm_smoke.disabled_reason or path.endswith("Super-120B-A12B-BF16/megatron_lm_ptq.yaml")


def test_nano_plan():
    cfg = compose_example(NANO, [])
    q, m, e = (ParallelDims.from_stage(cfg, s) for s in ("quantize", "mmlu", "export"))
    assert (q.ep, q.edp, q.world_size, q.tp, q.pp, q.etp) == (4, 1, 4, 1, 1, 1)
    assert (m.ep, m.edp) == (4, 1)
    assert (e.pp, e.ep, e.tp) == (4, 1, 1)
    assert cfg.recipe.modelopt_cfg == "NVFP4_DEFAULT_CFG"
    assert cfg.stages.quantize.calib.size == 32 and cfg.stages.quantize.calib.max_seq_len == 4096
    assert cfg.stages.mmlu.fraction == 0.01 and cfg.stages.mmlu.lower_bound == 0.60
    assert cfg.stages.vllm_smoke.enabled and cfg.stages.vllm_smoke.mode == "offline"
    assert cfg.stages.vllm_smoke.tensor_parallel_size == 1
    assert cfg.model.num_experts == 128 and len(cfg.model.hybrid_pattern) == 52


BROKEN = [
    (NANO, ["stages.quantize.parallel.ep=3"],
     "stages.quantize.parallel.ep=3: must divide model.num_experts=128 (valid: 1, 2, 4, 8, 16, 32, 64, 128)"),
    (NANO, ["stages.export.parallel.ep=4", "stages.export.parallel.pp=1"],
     "stages.export.parallel.ep=4: must be 1: ModelOpt's Megatron->HF export silently corrupts"),
    (NANO, ["stages.export.parallel.tp=2", "stages.export.parallel.pp=2"], "stages.export.parallel.tp=2: must be 1"),
    (NANO, ["stages.export.parallel.pp=3", "stages.export.parallel.world_size=3"],
     "stages.export.parallel.pp=3: must divide the hybrid pattern's 52 layers"),
    (NANO, ["stages.mmlu.parallel.tp=4", "stages.mmlu.parallel.world_size=4", "stages.mmlu.parallel.ep=1"],
     "stages.mmlu.parallel.tp=4: must divide model.num_query_groups=2 (valid: 1, 2)"),
    (NANO, ["stages.mmlu.fraction=1.5"], "stages.mmlu.fraction=1.5: must satisfy 0 < fraction <= 1"),
    (NANO, ["stages.mmlu.fraction=0"], "stages.mmlu.fraction=0.0: must satisfy 0 < fraction <= 1"),
    (NANO, ["stages.mmlu.lower_bound=1.2"], "stages.mmlu.lower_bound=1.2: must be null or in [0, 1]"),
    (NANO, ["stages.mmlu.shard_mode=dense_dp"], "stages.mmlu.shard_mode='dense_dp': shards batches over the dense"),
    (NANO, ["stages.mmlu.shard_mode=round_robin"],
     "stages.mmlu.shard_mode='round_robin': valid: auto, balanced, lockstep, dense_dp"),
    (NANO, ["stages.mmlu.max_drop=0.02"], "stages.mmlu.max_drop=0.02: needs a baseline"),
    (NANO, ["stages.mmlu.baseline=recorded"], "stages.mmlu.baseline_accuracy=None: required with baseline=recorded"),
    (NANO, ["stages.quantize.parallel.world_size=6"], "stages.quantize.parallel.world_size=6: world_size 6 is not divisible by etp(1) * ep(4) * pp(1) = 4; "
     "valid world sizes are multiples of 4"),
    (NANO, ["recipe=nvfp4_fancy"], "valid recipes: fp8_default, none, nvfp4_awq_lite, nvfp4_default"),
    (NANO, ["stages.mmlu.bogus=1"], "unknown key 'stages.mmlu.bogus'; valid keys here: add_bos"),
    (NANO, ["+stages.quantize.calib.shuffle=true"], "unknown key 'stages.quantize.calib.shuffle'"),
    (NANO, ["stages.mmlu.batch_size=eight"], "stages.mmlu.batch_size='eight': valid: 'auto' (token budget from the device) or an integer >= 1"),
    (NANO, ["stages.mmlu.batch_size=0"], "stages.mmlu.batch_size=0: valid: 'auto'"),
    (NANO, ["executor.device=tpu"], "executor.device='tpu': valid: auto, cpu, cuda"),
    (NANO, ["job_name=my job"], "job_name='my job': use letters, digits"),
    (NANO, ["stages.vllm_smoke.enabled=true", "stages.export.enabled=false"],
     "stages.vllm_smoke.enabled=True: serves stages.export's checkpoint"),
    (NANO, ["model.architecture=MixtralForCausalLM"], "model.architecture='MixtralForCausalLM': not supported; valid: Qwen3MoeForCausalLM"),
    (os.path.join(ROOT, "examples/meta-llama/Llama-3.2-1B-Instruct/megatron_lm_ptq.yaml"),
     ["stages.mmlu.parallel.ep=2"], "stages.mmlu.parallel.ep=2: model Llama-3.2-1B-Instruct is dense (no experts): ep and etp must be 1"),
    (NANO, ["model=from_checkpoint", "model.path=/nonexistent/ckpt"],
     "model.path='/nonexistent/ckpt': no config.json there; model=from_checkpoint needs a local checkpoint"),
]


@pytest.mark.parametrize("path, overrides, message", BROKEN, ids=[" ".join(b[1]) for b in BROKEN])
def test_broken_config_rejected_with_message(path, overrides, message):
    with pytest.raises(ConfigError) as e:
        validate(compose_example(path, overrides), check_paths=False)
    assert message in str(e.value)


def test_missing_dataset_path_fails_before_anything_starts(tmp_path):
    with pytest.raises(ConfigError) as e:
        validate(compose_example(NANO, [f"stages.mmlu.dataset={tmp_path}/missing"]), check_paths=True)
    assert f"stages.mmlu.dataset='{tmp_path}/missing': path does not exist" in str(e.value)


def test_card_checked_against_checkpoint_config(tmp_path):
    import json

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({
        "architectures": ["NemotronHForCausalLM"], "num_hidden_layers": 52, "hidden_size": 2688,
        "num_attention_heads": 32, "num_key_value_heads": 2, "n_routed_experts": 64, "num_experts_per_tok": 6,
        "hybrid_override_pattern": "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME", "vocab_size": 131072}))
    with pytest.raises(ConfigError) as e:
        validate(compose_example(NANO, [f"model.path={ckpt}"]), check_paths=False)
    assert f"model.num_experts=128: the checkpoint's config.json says 64 ({ckpt})" in str(e.value)
    # from_checkpoint reads every dimension from it
    cfg = compose_example(NANO, ["model=from_checkpoint", f"model.path={ckpt}"])
    assert (cfg.model.architecture, cfg.model.num_experts, cfg.model.moe_topk, cfg.model.num_layers) == (
        "NemotronHForCausalLM", 64, 6, 52)
    assert cfg.model.name == "ckpt"


def test_composition_imports_no_torch():
    code = ("import sys; from launcher.config.compose import compose_example; from launcher.config.validate import validate;"
            f"validate(compose_example({NANO!r}, []), check_paths=False); assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_dataset_that_is_not_an_mmlu_layout_is_refused(tmp_path):
    with pytest.raises(ConfigError) as e:
        validate(compose_example(NANO, [f"stages.mmlu.dataset={tmp_path}"]), check_paths=True)
    assert f"stages.mmlu.dataset='{tmp_path}': directory is neither an HF datasets dir in the cais/mmlu layout" in str(e.value)


# Nemotron-H config.json contents as the hub files state them (dimensions as in Megatron-LM's ModelOpt
# example configurations for these models, examples/post_training/modelopt/conf/nvidia/*.sh); Nano's
# lives beside its example (benchmarks/nano_width.py builds its real-width models from it)
NANO_PATTERN = "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"
SUPER_PATTERN = "MEMEMEM*EMEMEMEM*EMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEM*EMEMEMEME"
with open(os.path.join(ROOT, "examples/nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16/config.json")) as _f:
    NANO_CONFIG = json.load(_f)
SUPER_CONFIG = {
    **NANO_CONFIG, "num_hidden_layers": 88, "hybrid_override_pattern": SUPER_PATTERN, "hidden_size": 4096,
    "intermediate_size": 2688, "mamba_num_heads": 128, "n_routed_experts": 512, "num_experts_per_tok": 22,
    "moe_shared_expert_intermediate_size": 5376, "routed_scaling_factor": 5.0, "moe_latent_size": 1024,
    "num_nextn_predict_layers": 1}
SUPER = os.path.join(ROOT, "examples/nvidia/NVIDIA-Nemotron-3-Super-120B-A12B-BF16/megatron_lm_ptq.yaml")
BLOCK_NAMES = {"M": "mamba", "E": "moe", "*": "attention"}


def _checkpoint(tmp_path, config: dict, name: str = "ckpt") -> str:
    import json

    ckpt = tmp_path / name
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps(config))
    return str(ckpt)


def _transformers5_format(config: dict) -> dict:
    """What transformers >= 5 save_pretrained writes: layers_block_type, no num_hidden_layers."""
    out = {k: v for k, v in config.items() if k not in ("num_hidden_layers", "hybrid_override_pattern")}
    out["layers_block_type"] = [BLOCK_NAMES[c] for c in config["hybrid_override_pattern"]]
    return out


@pytest.mark.parametrize("fmt", ["hub", "transformers5"])
def test_nano_card_agrees_with_its_config_json_in_both_formats(tmp_path, fmt):
    config = NANO_CONFIG if fmt == "hub" else _transformers5_format(NANO_CONFIG)
    ckpt = _checkpoint(tmp_path, config)
    validate(compose_example(NANO, [f"model.path={ckpt}"]), check_paths=False)   # the card agrees
    cfg = compose_example(NANO, ["model=from_checkpoint", f"model.path={ckpt}"])
    validate(cfg, check_paths=False)
    assert (cfg.model.num_layers, cfg.model.hybrid_pattern, cfg.model.num_experts, cfg.model.moe_topk,
            cfg.model.num_query_groups) == (52, NANO_PATTERN, 128, 6, 2)


def test_super_card_agrees_with_its_config_json_and_latent_moe_is_refused_before_start(tmp_path):
    ckpt = _checkpoint(tmp_path, SUPER_CONFIG)
    with pytest.raises(ConfigError) as e:
        validate(compose_example(SUPER, [f"model.path={ckpt}"]), check_paths=False)
    lines = str(e.value).splitlines()[1:]
    assert len(lines) == 1, lines        # every dimension agrees: the only problem is LatentMoE
    assert "config.json moe_latent_size=1024 is not supported" in lines[0]


@pytest.mark.parametrize("drop, message", [
    ("hidden_size", "config.json lacks hidden_size (one of ['hidden_size', 'd_model', 'n_embd'])"),
    ("hybrid_override_pattern", "has neither hybrid_override_pattern nor layers_block_type"),
    ("architectures", "config.json has no 'architectures' entry"),
])
def test_unreadable_nemotron_h_config_json_is_a_validation_error_naming_the_key(tmp_path, drop, message):
    ckpt = _checkpoint(tmp_path, {k: v for k, v in NANO_CONFIG.items() if k != drop})
    with pytest.raises(ConfigError) as e:
        compose_example(NANO, ["model=from_checkpoint", f"model.path={ckpt}"])
    assert message in str(e.value) and f"model.path={ckpt!r}" in str(e.value)


def test_transformers5_config_without_num_hidden_layers_validates(tmp_path):
    """Measured 2026-12-02: this config.json made `launch validate` die with omegaconf's
    MissingMandatoryValue: model.num_layers."""
    config = _transformers5_format({**NANO_CONFIG, "hybrid_override_pattern": "M*ME", "n_routed_experts": 8,
                                    "num_experts_per_tok": 2})
    ckpt = _checkpoint(tmp_path, config)
    cfg = compose_example(NANO, ["model=from_checkpoint", f"model.path={ckpt}",
                                 "stages.export.parallel.pp=2", "stages.export.parallel.world_size=2"])
    validate(cfg, check_paths=False)
    assert (cfg.model.num_layers, cfg.model.hybrid_pattern, cfg.model.num_experts) == (4, "M*ME", 8)
    bad = _checkpoint(tmp_path, {**config, "layers_block_type": ["mamba", "gdn", "moe", "attention"]}, "bad")
    with pytest.raises(ConfigError, match=r"layers_block_type has unknown types \['gdn'\]"):
        compose_example(NANO, ["model=from_checkpoint", f"model.path={bad}"])


@pytest.mark.parametrize("pattern, pp, message", [
    ("MEM*|EMEM", 2, None),
    ("MEM*|EMEM", 4, "stages.export.parallel.pp=4: must equal the 2 '|'-delimited stages"),
    ("MEM*EMEM", 3, "stages.export.parallel.pp=3: must divide the hybrid pattern's 8 layers: Megatron gives every "
                    "pipeline stage the same number of whole layers (valid: 1, 2, 4, 8)"),
    ("MEQ*EMEM", 2, "model.hybrid_pattern='MEQ*EMEM': has symbols ['Q']"),
    ("MEM*EMEM", 2, None),
])
def test_pipeline_stages_get_whole_layers_of_the_hybrid_pattern(pattern, pp, message):
    """'|' in a pattern fixes Megatron's stages: then every stage's pp must equal their number."""
    overrides = [f"model.hybrid_pattern={pattern}", "model.num_layers=8"]
    for stage in ("quantize", "mmlu", "export"):
        overrides += [f"stages.{stage}.parallel.pp={pp}", f"stages.{stage}.parallel.ep=1",
                      f"stages.{stage}.parallel.world_size={pp}"]
    if message is None:
        validate(compose_example(NANO, overrides), check_paths=False)
        return
    with pytest.raises(ConfigError) as e:
        validate(compose_example(NANO, overrides), check_paths=False)
    assert message in str(e.value)


def test_nemotron_h_tensor_parallel_is_refused_before_start():
    with pytest.raises(ConfigError) as e:
        validate(compose_example(NANO, ["stages.mmlu.parallel.tp=2", "stages.mmlu.parallel.world_size=8"]),
                 check_paths=False)
    assert "stages.mmlu.parallel.tp=2: must be 1 for NemotronHForCausalLM" in str(e.value)
