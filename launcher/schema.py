"""Structured-config schema: every key of a pipeline config, typed.

Values live in YAML (examples/, launcher/conf/, recipes/); these dataclasses give every key a
type and make unknown keys errors (OmegaConf struct mode).  Registered with Hydra's ConfigStore
in ``launcher.config.compose``.  Every key also says what is valid (``launcher.schema_rules``):
numbers a range, paths a kind, strings a syntax or ``text``; choice keys are Enums; a key whose
rule belongs to a library's checker names it (``owned``), and validation calls that checker.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Union

from omegaconf import MISSING

from launcher.contract import STAGE_ORDER  # the stage names are the contract's
from launcher.contract import (
    BaselineMode, Device, Dispatcher, Dtype, Nvfp4Kernels, OnUnsupported, RankStart, ShardMode, VllmMode, VllmScoring,
    values)
from launcher.formats import FormatName
from launcher.schema_rules import owned, path, pattern, ranged, text

_NAME = r"[A-Za-z0-9][A-Za-z0-9._-]*"
_NAME_HINT = "use letters, digits, '.', '_' and '-' (it names the run directory)"
_PORT = dict(lo=1, hi=65535)

SHARD_MODES = values(ShardMode)
VLLM_MODES = values(VllmMode)
VLLM_SCORING = values(VllmScoring)
ON_UNSUPPORTED = values(OnUnsupported)
DEVICES = values(Device)
DISPATCHERS = values(Dispatcher)
BASELINE_MODES = values(BaselineMode)


@dataclass
class ModelCard:
    """A checkpoint and the dimensions parallelism must divide."""

    name: str = text()
    architecture: str = owned("launcher.architectures (ARCHITECTURES)")  # HF `architectures[0]`
    path: str = path(kind="dir", hub_ok=True)   # local HF checkpoint directory (or hub id when online)
    from_checkpoint: bool = False      # fill the dimensions below from path/config.json
    num_layers: int = ranged(lo=1)
    hidden_size: int = ranged(lo=1)
    num_attention_heads: int = ranged(lo=1)
    num_query_groups: int = ranged(lo=1)
    num_experts: int = ranged(0, lo=0, note="0: dense")
    moe_topk: int = ranged(0, lo=0, note="1..num_experts for an MoE model")
    # e.g. Nemotron-H "MEMEM*E..." (M mamba, E MoE, * attn, - MLP)
    hybrid_pattern: Optional[str] = owned("launcher.hf_config (PATTERN_SYMBOLS)", None)
    vocab_size: Optional[int] = ranged(None, lo=1)
    trust_remote_code: bool = False


@dataclass
class RecipeConfig:
    """A quantization recipe: a named ModelOpt config, a ModelOpt recipe YAML, or none."""

    name: str = text()
    format: FormatName = MISSING       # nvfp4 | fp8 | none (launcher/formats.py): what export must contain
    # e.g. NVFP4_DEFAULT_CFG (attribute of modelopt.torch.quantization)
    modelopt_cfg: Optional[str] = owned("launcher.quant.recipes.validate_recipe", None)
    # a ModelOpt recipe YAML instead of a named config (a file, or a ModelOpt built-in recipe name)
    recipe_path: Optional[str] = owned("launcher.quant.recipe_yaml.check_recipe_file", None)
    exclude_modules: list[str] = field(default_factory=list)  # extra wildcard patterns left unquantized
    quantize_experts: bool = True      # the stage fails if any expert is left unquantized
    description: str = text("")


@dataclass
class ParallelConfig:
    tp: int = ranged(1, lo=1)
    pp: int = ranged(1, lo=1)
    ep: int = ranged(1, lo=1)
    etp: int = ranged(1, lo=1)
    cp: int = ranged(1, lo=1)
    world_size: Optional[int] = ranged(None, lo=1)   # default: the smallest world the degrees divide


@dataclass
class ExecutorConfig:
    """What every executor takes; each kind (config group ``executor``) extends it."""

    kind: str = owned("launcher.config.compose (EXECUTOR_SCHEMAS)")   # local | slurm
    device: Device = Device.auto       # auto | cpu | cuda
    omp_num_threads: int = ranged(1, lo=1)
    collective_timeout_s: int = ranged(120, lo=0, lo_open=True)   # process-group timeout for every stage
    # master_port is each kind's own: a free port here (local), derived from the job id (slurm)


@dataclass
class LocalExecutorConfig(ExecutorConfig):
    kind: str = owned("launcher.config.compose (EXECUTOR_SCHEMAS)", "local")
    master_port: Optional[int] = ranged(None, **_PORT)  # default: a free port
    # auto: ranks forked from an agent that imported torch/Megatron/ModelOpt once where they cannot
    # use CUDA (CPU), spawned elsewhere; spawn: always new interpreters (launcher.executors.rank_start)
    rank_start: RankStart = RankStart.auto


@dataclass
class SlurmExecutorConfig(ExecutorConfig):
    kind: str = owned("launcher.config.compose (EXECUTOR_SCHEMAS)", "slurm")
    partition: Optional[str] = text(None)
    account: Optional[str] = text(None)
    qos: Optional[str] = text(None)
    time: str = owned("launcher.executors.slurm_script.valid_time", "01:00:00")
    nodes: int = ranged(1, lo=1)
    gpus_per_node: int = ranged(0, lo=0, note="0: no GPU request")
    cpus_per_task: Optional[int] = ranged(None, lo=1)
    mem: Optional[str] = text(None)
    container_image: Optional[str] = text(None)
    container_mounts: list[str] = field(default_factory=list)
    setup: list[str] = field(default_factory=list)  # shell lines run before srun (module load ...)
    python: str = text("python")       # interpreter inside the allocation
    env: dict[str, str] = field(default_factory=dict)
    sbatch_args: list[str] = field(default_factory=list)  # extra #SBATCH flags, e.g. ["--exclusive"]
    srun_args: list[str] = field(default_factory=list)    # extra srun flags, e.g. ["--mpi=pmix"]
    poll_interval_s: float = ranged(2.0, lo=0, lo_open=True)
    # 0: 20000 + job id % 20000 (jobs sharing a node never collide)
    master_port: int = ranged(0, lo=0, hi=65535, note="0: derived from the job id")


@dataclass
class CalibConfig:
    # jsonl (text | messages), .txt, or an HF datasets directory; its content: launcher.quant.calibration
    dataset: str = path(kind="any", when=lambda cfg: cfg.recipe.format != "none")
    size: int = ranged(32, lo=1)
    max_seq_len: int = ranged(4096, lo=1)
    batch_size: int = ranged(1, lo=1)
    text_key: str = pattern("text", r".+", "must be a non-empty field name")


@dataclass
class QuantizeStage:
    enabled: bool = True
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    calib: CalibConfig = field(default_factory=CalibConfig)
    dtype: Dtype = Dtype.bfloat16      # params dtype on GPU; CPU always runs fp32 (the gate's too: gate_dtype)
    moe_dispatcher: Dispatcher = Dispatcher.alltoall


@dataclass
class MmluStage:
    enabled: bool = True
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    # HF datasets dir (cais/mmlu layout), CSV dir, jsonl, or hub id; its content: launcher.mmlu.data
    dataset: str = path(kind="any", hub_ok=True)
    dev_dataset: Optional[str] = path(None, kind="any", hub_ok=True)  # few-shot source when `dataset` has no dev split
    fraction: float = ranged(1.0, lo=0, hi=1, lo_open=True)
    few_shots: int = ranged(0, lo=0)
    # auto: CUDA - token budget, no row cap; CPU - 8 rows
    batch_size: Union[int, str] = owned("launcher.mmlu.batching.resolve_limits", "auto")
    max_batch_tokens: Optional[int] = ranged(None, lo=1)  # token budget per batch (padded tokens); auto: from the device
    max_seq_len: int = ranged(4096, lo=1)
    add_bos: Optional[bool] = None     # None: as lm-evaluation-harness does for the tokenizer
    lower_bound: Optional[float] = owned("launcher.mmlu.gate.check_gate_config", None)
    max_drop: Optional[float] = owned("launcher.mmlu.gate.check_gate_config", None)
    baseline: BaselineMode = BaselineMode.none  # none | recorded | evaluate (or reuse its cache) | cached (cache only)
    baseline_accuracy: Optional[float] = owned("launcher.mmlu.gate.check_gate_config", None)  # baseline=recorded
    # per-question baseline cache (default <cache_dir()>/mmlu_baseline)
    baseline_cache_dir: Optional[str] = path(None, kind="dir", exists=False)
    shard_mode: ShardMode = ShardMode.auto  # auto | balanced | lockstep | dense_dp (tests only at EP>1)
    allow_unsafe_shard_mode: bool = False  # test flag: permit dense_dp at EP>1 (reproduces the hang)
    collective_timeout_s: int = ranged(45, lo=0, lo_open=True)   # the desync guard's and the gate's collectives
    moe_dispatcher: Dispatcher = Dispatcher.alltoall


@dataclass
class ExportStage:
    enabled: bool = True
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    name: str = pattern("hf", r"[\w.-]+", "must be a plain directory name")   # export/<name>
    dtype: Dtype = Dtype.bfloat16
    overwrite: bool = False
    verify: bool = True
    verify_samples: int = ranged(4, lo=1)   # modules per kind compared against the Megatron weights


@dataclass
class VllmSmokeStage:
    enabled: bool = False
    disabled_reason: str = text("")
    # vLLM's own tensor parallelism: the stage is one launcher rank, and vLLM starts this many
    # workers on that rank's node (one GPU each); vLLM has no pipeline or expert degree of ours
    tensor_parallel_size: int = ranged(1, lo=1)
    mode: VllmMode = VllmMode.server   # server | offline
    python: Optional[str] = path(None, kind="file")   # interpreter with vLLM (default: .venv-vllm, then this one)
    score_choices: bool = True         # score the gate's questions through vLLM, compare with mmlu/results.json
    # how many of the gate's questions (evenly spaced, gate order); 0: all
    questions: int = ranged(0, lo=0, note="0: every question the gate evaluated")
    scoring: VllmScoring = VllmScoring.prompt_logprobs  # prompt_logprobs | choice_logprobs: how vLLM scores " A".." D"
    # null: 0.99 for an unquantized export, 0.95 for a quantized one
    min_agreement: Optional[float] = ranged(None, lo=0, hi=1)
    # gate top-2 logit margin below which a question is reported, not counted
    tie_margin: float = ranged(0.25, lo=0, note="a logit margin; 0 counts every question")
    min_accuracy: Optional[float] = ranged(None, lo=0, hi=1)   # served accuracy floor; null: the gate's lower_bound
    prompts: Optional[str] = path(None, kind="file")   # generation checks: jsonl {prompt, contains | expected, chat}
    max_tokens: int = ranged(32, lo=1)  # greedy tokens per generation check
    startup_timeout_s: int = ranged(600, lo=0, lo_open=True)
    request_timeout_s: int = ranged(600, lo=0, lo_open=True)
    # serve this HF directory instead of export/<stages.export.name>
    model_dir: Optional[str] = path(None, kind="dir")
    on_unsupported: OnUnsupported = OnUnsupported.skip  # skip | fail
    force: bool = False                # skip the capability check (vLLM's own refusal is reported)
    # auto | emulation: vLLM's NVFP4 emulation quantizes activations as the gate does, so the agreement
    # judges an NVFP4 export at its own precision where vLLM's own choice is weight-only (Marlin, Hopper)
    nvfp4_kernels: Nvfp4Kernels = Nvfp4Kernels.auto
    extra_args: list[str] = field(default_factory=list)


@dataclass
class Stages:
    quantize: QuantizeStage = field(default_factory=QuantizeStage)
    mmlu: MmluStage = field(default_factory=MmluStage)
    export: ExportStage = field(default_factory=ExportStage)
    vllm_smoke: VllmSmokeStage = field(default_factory=VllmSmokeStage)


def enabled_stages(cfg) -> list[str]:
    """The names of a composed config's enabled stages, in pipeline order."""
    return [s for s in STAGE_ORDER if cfg.stages[s].enabled]


def gate_dtype(cfg) -> Dtype:
    """The dtype the MMLU gate builds its model in: the quantize stage's (the gate evaluates the
    checkpoint calibrated in that dtype, and its baseline in the same one, so the drop measures
    quantization only).  On CPU every stage runs float32 (launcher.megatron.models.resolve_dtype)."""
    return Dtype(cfg.stages.quantize.dtype)


@dataclass
class PipelineConfig:
    job_name: str = pattern(MISSING, _NAME, _NAME_HINT)
    note: str = text("")
    allow_to_fail: bool = False
    test_level: int = ranged(0, lo=0)
    runs_root: str = path("runs", kind="dir", exists=False)
    seed: int = ranged(1234, lo=0)
    model: ModelCard = MISSING
    recipe: RecipeConfig = MISSING
    executor: Any = MISSING            # an ExecutorConfig: LocalExecutorConfig | SlurmExecutorConfig (group `executor`)
    stages: Stages = field(default_factory=Stages)
    env: dict[str, str] = field(default_factory=dict)  # exported to every rank; secrets masked in config.yaml
