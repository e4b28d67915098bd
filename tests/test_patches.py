"""The register of process-wide patches (launcher.megatron.patches) and the mamba_ssm stub.

Every test that applies a patch does so in a fresh interpreter (``_run``) or a rank process: the
pytest process is never patched.  The stub tests run the path that found the H200 defect: with
the stub installed, pickle's module search (inductor's FX-graph cache key) and a rank's forward
through Megatron's torch.compile'd fused SwiGLU (``bias_activation_fusion``).
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from launcher_testing.ranks import REPO_ROOT, run_on_ranks

needs_mamba_ssm = pytest.mark.skipif(importlib.util.find_spec("mamba_ssm") is None,
                                     reason="mamba_ssm is not installed (scripts/setup_venv.sh installs it)")

pytestmark = pytest.mark.torch   # imports torch, Megatron or ModelOpt (in-process or in its ranks)


def _run(code: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": REPO_ROOT, "CUDA_VISIBLE_DEVICES": "",
                                            **(env or {})})


def test_register_entries_say_why_when_and_where():
    from launcher.megatron.patches import PATCHES

    owners = {"cpu_": "launcher.megatron.cpu_compat:", "modelopt_": "launcher.megatron.modelopt_fixes:",
              "moe_": "launcher.megatron.grouped_experts:", "mamba_": "launcher.megatron.mamba_ssm_compat:"}
    assert len(PATCHES) == 14
    for name, p in PATCHES.items():
        assert p.name == name and len(p.reason) > 20 and p.condition, p
        assert p.target.startswith(next(v for k, v in owners.items() if name.startswith(k))), p
        assert p.cpu_only == name.startswith("cpu_"), p


def test_importing_the_package_patches_nothing_and_pickle_works():
    """Defect 1 of the GPU-parity issue: ``import launcher.megatron`` installed the stub, whose
    ImportError broke pickle's module search (every torch.compile on the H200)."""
    out = _run("import sys, pickle, torch\n"
               "import launcher.megatron, launcher.megatron.models, launcher.megatron.dist, launcher.megatron.fold\n"
               "from launcher.megatron import patches\n"
               "pickle.dumps(torch.contiguous_format); pickle.dumps(torch.per_tensor_affine)\n"
               "print(patches.applied(), 'selective_scan_cuda' in sys.modules)")
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "[] False"


@needs_mamba_ssm
def test_mamba_stub_keeps_the_module_protocol():
    out = _run("import pickle, sys, torch\n"
               "from launcher.megatron import patches\n"
               "from launcher.megatron.mamba_ssm_compat import megatron_mamba_status, state\n"
               "assert state() == 'no-extension', state()\n"
               "assert patches.apply('mamba_ssm_stub') and state() == 'stubbed'\n"
               "stub = sys.modules['selective_scan_cuda']\n"
               "pickle.dumps(torch.contiguous_format); pickle.dumps(torch.per_tensor_affine)\n"
               "assert not hasattr(stub, 'torch') and getattr(stub, 'x', None) is None\n"
               "import mamba_ssm, selective_scan_cuda\n"
               "try:\n    selective_scan_cuda.fwd(1, 2)\nexcept RuntimeError as e:\n    print('fwd:', e)\n"
               "print(megatron_mamba_status())\n"
               "assert patches.undo('mamba_ssm_stub') and 'selective_scan_cuda' not in sys.modules\n"
               "print(state())")
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert lines[0].startswith("fwd: selective_scan_cuda.fwd: mamba_ssm was installed without its CUDA extension")
    assert lines[1] == "(True, 'mamba_ssm stubbed')"
    assert lines[2] == "no-extension"


def test_undo_restores_the_originals_and_cpu_patches_refuse_where_cuda_is_visible():
    out = _run("import torch\n"
               "import megatron.core.transformer.moe.token_dispatcher as td\n"
               "from launcher.megatron import patches\n"
               "from launcher.megatron.cpu_compat import apply_cpu_compat\n"
               "before = (torch.cuda.current_device, torch.cuda.Stream, td.maybe_move_tensor_to_cpu)\n"
               "names = apply_cpu_compat()\n"
               "assert torch.cuda.current_device() == 'cpu' and apply_cpu_compat() == names\n"
               "print(names)\n"
               "patches.undo_all()\n"
               "assert (torch.cuda.current_device, torch.cuda.Stream, td.maybe_move_tensor_to_cpu) == before\n"
               "assert patches.applied() == [] and patches.applied_in_process() == names\n"
               "assert apply_cpu_compat() == names and patches.applied() == names\n"
               "patches.forget_applied_in_process()\n"
               "assert (torch.cuda.current_device, torch.cuda.Stream, td.maybe_move_tensor_to_cpu) == before\n"
               "assert patches.applied() == [] and patches.applied_in_process() == []\n"
               "torch.cuda.is_available = lambda: True   # a process that can see a GPU\n"
               "try:\n    patches.apply('cpu_streams')\nexcept patches.PatchRefused as e:\n"
               "    print(int(e.exit_code), e)\n")
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    applied = json.loads(lines[0].replace("'", '"'))
    assert applied[:6] == ["cpu_current_device", "cpu_streams", "cpu_alltoall_split_sizes", "cpu_pipeline_schedules",
                           "cpu_nvfp4_dynamic_block_quant", "cpu_tied_embeddings_pp"], applied
    assert "cpu_mamba_reference_kernels" not in applied   # no stub, no hybrid rank: mamba is left alone
    assert lines[1].startswith("5 patch cpu_streams is for CPU ranks only (the alltoall token dispatcher creates a "
                               "torch.cuda.Stream in __init__) but this process can see a CUDA device"), lines[1]


def test_local_executor_hides_gpus_from_cpu_ranks():
    from omegaconf import OmegaConf

    from launcher.schema import LocalExecutorConfig
    from launcher.executors.base import StagePlan
    from launcher.executors.local import LocalExecutor

    def env_of(device):
        cfg = OmegaConf.merge(OmegaConf.structured(LocalExecutorConfig), {"device": device})
        plan = StagePlan(name="quantize", world_size=1, argv=[], env={}, log_path="/dev/null")
        return LocalExecutor(cfg, run_dir="/nonexistent").environment(plan)

    assert env_of("cpu")["CUDA_VISIBLE_DEVICES"] == ""
    assert env_of("auto").get("CUDA_VISIBLE_DEVICES") == os.environ.get("CUDA_VISIBLE_DEVICES")


def compiled_swiglu_worker(hf_path: str) -> dict:
    """A rank with the mamba stub installed runs a forward of a GPT MoE model through Megatron's
    torch.compile'd fused SwiGLU (dense and grouped experts), against the unfused model."""
    import torch

    from launcher.megatron import patches
    from launcher.megatron.dist import init_distributed, shutdown
    from launcher.megatron.forward import forward_logits
    from launcher.megatron.hf_io import import_hf_weights
    from launcher.megatron.models import build_model
    from launcher.mmlu.evaluate import prepare_model_for_eval
    from launcher.topology import ParallelDims

    stubbed = patches.apply("mamba_ssm_stub")   # the worst case: a GPT rank where the stub is present
    dims = ParallelDims(world_size=1)
    init_distributed(dims, "cpu", timeout_s=120, seed=1234)
    tokens = torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(7))
    out = {"stubbed": stubbed}
    for fused in (False, True):
        model = build_model(hf_path, dims, "cpu", "float32", "alltoall", fused_activation=fused)
        import_hf_weights(model, hf_path, "float32")
        prepare_model_for_eval(model)   # grouped experts: weighted_bias_swiglu_impl when fused
        out[str(fused)] = forward_logits(model, tokens)
    out["fusion"] = bool(model.config.bias_activation_fusion)
    out["max_abs_diff"] = float((out["True"] - out["False"]).abs().max())
    out["same_argmax"] = bool(torch.equal(out["True"].argmax(-1), out["False"].argmax(-1)))
    del out["True"], out["False"]
    shutdown()
    return out


@pytest.mark.slow
def test_compiled_fused_swiglu_runs_with_the_stub(random_tiny_moe):
    [r] = run_on_ranks("test_patches:compiled_swiglu_worker", nprocs=1, timeout_s=600,
                       kwargs={"hf_path": random_tiny_moe}, env={"CUDA_VISIBLE_DEVICES": ""})
    assert r["stubbed"] is (importlib.util.find_spec("mamba_ssm") is not None), r
    assert r["fusion"] is True and r["same_argmax"], r
    assert r["max_abs_diff"] < 1e-4, r


def test_transformer_engine_specs_are_refused_with_the_reason():
    pytest.importorskip("megatron.core")
    from launcher.megatron.hybrid_spec import nemotron_h_stack_spec
    from launcher.megatron.models import TE_SPEC_REFUSAL

    with pytest.raises(ValueError) as e:
        nemotron_h_stack_spec(use_te=True)
    assert str(e.value) == TE_SPEC_REFUSAL and "no TE-spec model has completed the gate here" in TE_SPEC_REFUSAL
    assert nemotron_h_stack_spec(use_te=False).submodules.mamba_layer is not None


def test_stages_share_the_kernel_caches_unless_the_user_chose_them():
    from launcher.worker import share_kernel_caches

    env = {"TORCHINDUCTOR_CACHE_DIR": "/mine"}
    chosen = share_kernel_caches("/c", env)
    assert chosen == {"TRITON_CACHE_DIR": "/c/kernels/triton", "TRITON_CACHE_AUTOTUNING": "1"}
    assert env == {"TORCHINDUCTOR_CACHE_DIR": "/mine", **chosen}
    assert share_kernel_caches("/other", env) == {}   # set once: every rank of every stage agrees
