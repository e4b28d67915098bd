"""launcher.vllm.kernels: vLLM's kernel statements, read from its log (lines in vLLM 0.26's formats:
its format strings "Using '%s' NvFp4 MoE backend out of potential backends: %s.", "Using %s for
NVFP4 GEMM" and "Selected %s for %s", behind the engine-core process prefix and logger header)."""
from launcher.vllm import kernels

NVFP4_LOG = """\
(EngineCore_DP0 pid=4242) INFO 12-04 18:20:01 [gpu_model_runner.py:3050] Starting to load model /tmp/run/export/hf...
(EngineCore_DP0 pid=4242) INFO 12-04 18:20:01 [cuda.py:351] Using FLASH_ATTN attention backend out of potential backends: ['FLASH_ATTN', 'FLASHINFER', 'TRITON_ATTN'].
(EngineCore_DP0 pid=4242) INFO 12-04 18:20:02 [__init__.py:978] Using MarlinNvFp4LinearKernel for NVFP4 GEMM
(EngineCore_DP0 pid=4242) INFO 12-04 18:20:02 [nvfp4.py:239] Using 'MARLIN' NvFp4 MoE backend out of potential backends: ['FLASHINFER_TRTLLM', 'FLASHINFER_CUTLASS', 'VLLM_CUTLASS', 'MARLIN', 'EMULATION'].
(EngineCore_DP0 pid=4242) INFO 12-04 18:20:02 [__init__.py:978] Using MarlinNvFp4LinearKernel for NVFP4 GEMM
(EngineCore_DP0 pid=4242) WARNING 12-04 18:20:03 [marlin_utils_fp4.py:210] Your GPU does not have native support for FP4 computation but FP4 quantization is being used. Weight-only FP4 compression will be used leveraging the Marlin kernel.
"""


def test_nvfp4_on_hopper_reads_marlin_in_order_once():
    choices = kernels.read_choices(NVFP4_LOG.splitlines())
    assert choices == ["Using FLASH_ATTN attention backend", "Using MarlinNvFp4LinearKernel for NVFP4 GEMM",
                       "Using 'MARLIN' NvFp4 MoE backend"]
    assert kernels.family(choices) == "marlin"


def test_fp8_cutlass_and_emulation_and_unquantized():
    fp8 = ["INFO 12-04 [__init__.py:605] Selected CutlassFP8ScaledMMLinearKernel for ModelOptFp8LinearMethod",
           "INFO 12-04 [fp8.py:325] Using 'TRITON' Fp8 MoE backend out of potential backends: ['DEEPGEMM', 'TRITON']."]
    assert kernels.read_choices(fp8) == ["Selected CutlassFP8ScaledMMLinearKernel for ModelOptFp8LinearMethod",
                                         "Using 'TRITON' Fp8 MoE backend"]
    assert kernels.family(kernels.read_choices(fp8)) == "cutlass"
    emulated = ["INFO [__init__.py:978] Using EmulationNvFp4LinearKernel for NVFP4 GEMM"]
    assert kernels.family(kernels.read_choices(emulated)) == "emulation"
    bf16 = ["INFO [cuda.py:351] Using FLASH_ATTN attention backend out of potential backends: ['FLASH_ATTN']."]
    assert kernels.family(kernels.read_choices(bf16)) == "unquantized"


def test_read_log_of_a_missing_file_is_empty(tmp_path):
    assert kernels.read_log(str(tmp_path / "absent.log")) == {"choices": [], "family": "unquantized"}
    log = tmp_path / "vllm.log"
    log.write_text(NVFP4_LOG)
    assert kernels.read_log(str(log))["family"] == "marlin"


def test_an_attempt_reads_only_its_own_lines_of_the_appended_stage_log(tmp_path):
    """The stage's log keeps every attempt (a resumed smoke appends).  On an H100 (2026-12-06,
    benchmarks/results/2026-12-06-h100-smollm2-vllm.json) an `auto` attempt served SmolLM2's NVFP4
    export through Marlin alone, yet was reported as `emulation`: an earlier emulation attempt's
    line was read too.  From the attempt's start offset only its own statements count."""
    log = tmp_path / "log.txt"
    earlier = ("[vllm_smoke r0 03:36:20] offline: 16 gate questions (prompt_logprobs)\n"
               "INFO 12-06 03:36:40 [__init__.py:978] Using EmulationNvFp4LinearKernel for NVFP4 GEMM\n")
    log.write_text(earlier)
    start = kernels.log_size(str(log))
    assert start == len(earlier.encode())
    with open(log, "a") as f:
        f.write(NVFP4_LOG)
    assert kernels.read_log(str(log))["family"] == "emulation"          # the whole log: the defect
    mine = kernels.read_log(str(log), start)
    assert mine == {"choices": ["Using FLASH_ATTN attention backend", "Using MarlinNvFp4LinearKernel for NVFP4 GEMM",
                                "Using 'MARLIN' NvFp4 MoE backend"], "family": "marlin"}
    assert kernels.log_size(str(tmp_path / "absent.log")) == 0


def test_only_marlin_is_named_as_not_the_exports_own_precision():
    """The Nano-width NVFP4 export on an H100 (benchmarks/results/2026-12-05-h100-nano-width.json):
    served through Marlin, agreement 0.771; the failure says Marlin is weight-only."""
    assert "weight-only" in kernels.precision_note("marlin")
    assert [kernels.precision_note(f) for f in ("cutlass", "flashinfer", "triton", "emulation", "unquantized",
                                                "other")] == [None] * 6


def test_emulation_flags_only_for_an_nvfp4_export():
    """nvfp4_kernels=emulation adds vLLM's flags for its NVFP4 emulation (dense and MoE layers) to an
    NVFP4 export's engine; auto adds none, and an FP8 or unquantized export gets none either way."""
    assert kernels.serving_args("emulation", "NVFP4") == [
        "--linear-backend", "emulation", "--moe-backend", "emulation"]
    assert [kernels.serving_args(k, a) for k, a in (("auto", "NVFP4"), ("emulation", "FP8"), ("emulation", None))] \
        == [[], [], []]
    assert kernels.precision_note("marlin").endswith("stages.vllm_smoke.nvfp4_kernels=emulation serves an NVFP4 "
                                                      "export at it")


def test_the_stage_puts_the_emulation_flags_before_the_users_extra_args(tmp_path):
    """The smoke's backend gets the flags of nvfp4_kernels first and stages.vllm_smoke.extra_args after
    them (a user's own --linear-backend, later on the command line, wins)."""
    from types import SimpleNamespace

    from launcher.stages import vllm_smoke

    def backend(kind: str, algo):
        sc = SimpleNamespace(mode="offline", nvfp4_kernels=kind, extra_args=["--max-model-len", 512],
                             tensor_parallel_size=1, startup_timeout_s=60, request_timeout_s=60)
        layout = SimpleNamespace(log=lambda name: str(tmp_path / f"{name}.log"))
        ctx = SimpleNamespace(stage_cfg=sc, layout=layout, name="vllm_smoke", stage_dir=str(tmp_path),
                              log=print)
        return vllm_smoke._backend(ctx, str(tmp_path), "python3", "cuda", kernels.serving_args(kind, algo))

    assert list(backend("emulation", "NVFP4").extra_args) == [
        "--linear-backend", "emulation", "--moe-backend", "emulation", "--max-model-len", "512"]
    assert list(backend("auto", "NVFP4").extra_args) == ["--max-model-len", "512"]
    assert list(backend("emulation", "FP8").extra_args) == ["--max-model-len", "512"]
