"""Run a function on N gloo ranks as real subprocesses, with a timeout; tiny HF checkpoints.

    results = run_on_ranks("test_megatron_model:logits_worker", nprocs=4,
                           kwargs={"hf_path": str(path)}, timeout_s=240)

Each rank is ``python tests/distributed_utils.py MODULE:FUNCTION KWARGS_JSON RESULT_DIR`` with
RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT set (as torchrun would) and
OMP_NUM_THREADS=1.  The function is called as ``function(**kwargs)``; what it returns (JSON-able)
is collected per rank.  Any rank failing, or the run exceeding ``timeout_s``, raises
``RanksFailed`` carrying every rank's output tail; on timeout the ranks are killed.  The entry
point has the ``__main__`` guard that dist_checkpointing's writer needs.
"""
from __future__ import annotations

import importlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class RanksFailed(AssertionError):
    def __init__(self, message: str, returncodes: list, outputs: list[str], timed_out: bool):
        super().__init__(message)
        self.returncodes = returncodes
        self.outputs = outputs
        self.timed_out = timed_out


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_on_ranks(target: str, nprocs: int, kwargs: dict | None = None, timeout_s: float = 300,
                 env: dict[str, str] | None = None, tail_chars: int = 6000) -> list:
    """Run ``target`` ("package.module:function") on ``nprocs`` ranks; return each rank's result."""
    if os.environ.get("PTQ_TORCH_FREE") == "1":
        raise AssertionError(f"{target}: starts torch ranks in a torch-free run (make test-fast); mark the test `torch`")
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="ranks-") as workdir:
        procs, logs = [], []
        for rank in range(nprocs):
            rank_env = {
                **os.environ,
                "RANK": str(rank), "WORLD_SIZE": str(nprocs), "LOCAL_RANK": str(rank),
                "LOCAL_WORLD_SIZE": str(nprocs), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
                "PYTHONPATH": os.pathsep.join([REPO_ROOT, os.path.join(REPO_ROOT, "tests"), os.environ.get("PYTHONPATH", "")]),
                "PYTHONWARNINGS": "ignore",
                **(env or {}),
            }
            log = open(os.path.join(workdir, f"rank{rank}.log"), "w+")
            logs.append(log)
            procs.append(subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), target, json.dumps(kwargs or {}), workdir],
                env=rank_env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT, start_new_session=True))
        deadline = time.time() + timeout_s
        timed_out = False
        while any(p.poll() is None for p in procs):
            if time.time() > deadline:
                timed_out = True
                break
            if any(p.returncode not in (None, 0) for p in procs):
                # one rank died: give the others a moment to fail on their own, then stop them
                grace = time.time() + 20
                while time.time() < grace and any(p.poll() is None for p in procs):
                    time.sleep(0.2)
                break
            time.sleep(0.2)
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)   # our own child's process group
                p.wait()
        outputs = []
        for log in logs:
            log.seek(0)
            outputs.append(log.read()[-tail_chars:])
            log.close()
        codes = [p.returncode for p in procs]
        if timed_out or any(c != 0 for c in codes):
            detail = "\n".join(f"----- rank {r} (exit {c}) -----\n{out}" for r, (c, out) in enumerate(zip(codes, outputs)))
            why = f"timed out after {timeout_s} s" if timed_out else f"exit codes {codes}"
            raise RanksFailed(f"{target} on {nprocs} ranks: {why}\n{detail}", codes, outputs, timed_out)
        results = []
        for rank in range(nprocs):
            with open(os.path.join(workdir, f"result{rank}.json")) as f:
                results.append(json.load(f))
        return results


# ---------------------------------------------------------------- tiny HF checkpoints (transformers)

TINY_VOCAB = 264   # 256 byte-level tokens + <|endoftext|>, padded to a multiple of 8


def write_byte_tokenizer(path: str) -> None:
    """A byte-level BPE tokenizer without merges (256 byte tokens + EOS), saved with save_pretrained."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    vocab["<|endoftext|>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}")
    fast.save_pretrained(path)


def write_tiny_qwen3_moe(path: str, num_layers: int = 4, seed: int = 0) -> str:
    """A random Qwen3-MoE checkpoint: hidden 64, 4 heads (2 KV) of dim 32, 8 experts top-2, fp32."""
    import torch
    import transformers

    config = transformers.Qwen3MoeConfig(
        vocab_size=TINY_VOCAB, hidden_size=64, num_hidden_layers=num_layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, intermediate_size=128, moe_intermediate_size=64,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[], max_position_embeddings=128, rms_norm_eps=1e-6, rope_theta=10000.0,
        tie_word_embeddings=False, hidden_act="silu", eos_token_id=256, pad_token_id=256,
        bos_token_id=None)
    torch.manual_seed(seed)
    model = transformers.Qwen3MoeForCausalLM(config).float().eval()
    with torch.no_grad():  # larger than the 0.02 default init so that logits differ visibly
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
    model.save_pretrained(path)
    write_byte_tokenizer(path)
    return path


def write_tiny_nemotron_h(path: str, pattern: str = "MEM*EMEM", seed: int = 0) -> str:
    """A random Nemotron-H checkpoint shaped like Nano (Mamba-2 with groups, MoE with a shared
    relu2 expert and sigmoid routing, attention without positions): hidden 64, Mamba 8 heads of
    16 in 2 groups (state 16), attention 4 heads (2 KV) of 16, 8 experts top-2, fp32."""
    import torch
    import transformers

    config = transformers.NemotronHConfig(
        vocab_size=TINY_VOCAB, hidden_size=64, hybrid_override_pattern=pattern,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96,
        mamba_num_heads=8, mamba_head_dim=16, n_groups=2, ssm_state_size=16, conv_kernel=4,
        chunk_size=8, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=48, routed_scaling_factor=2.5, max_position_embeddings=128,
        # transformers' CPU (naive) Mamba path clamps dt at time_step_min; its CUDA-kernel path,
        # mamba_ssm and Megatron do not (dt_limit (0, inf)).  A tiny minimum keeps the clamp inert.
        time_step_min=1e-6, time_step_floor=1e-6, layer_norm_epsilon=1e-5, tie_word_embeddings=False, eos_token_id=256, pad_token_id=256,
        bos_token_id=None)
    torch.manual_seed(seed)
    model = transformers.NemotronHForCausalLM(config).float().eval()
    with torch.no_grad():  # larger than the default init; a nonzero expert bias that matters
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.linspace(-0.05, 0.05, b.numel()))
    model.save_pretrained(path)
    write_byte_tokenizer(path)
    return path


def hf_logits(path: str, tokens, **config_overrides) -> "object":
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, **config_overrides).eval()
    with torch.no_grad():
        return model(tokens, use_cache=False).logits


def _main(target: str, kwargs_json: str, workdir: str) -> None:
    module_name, _, func_name = target.partition(":")
    sys.path[:0] = [REPO_ROOT, os.path.join(REPO_ROOT, "tests")]
    func = getattr(importlib.import_module(module_name), func_name)
    result = func(**json.loads(kwargs_json))
    rank = int(os.environ["RANK"])
    with open(os.path.join(workdir, f"result{rank}.json.tmp"), "w") as f:
        json.dump(result, f)
    os.replace(os.path.join(workdir, f"result{rank}.json.tmp"), os.path.join(workdir, f"result{rank}.json"))


if __name__ == "__main__":
    _main(*sys.argv[1:4])
