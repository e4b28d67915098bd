"""Structured-config schema: every key of a pipeline config, typed.

Values live in YAML (examples/, launcher/conf/, recipes/); these dataclasses give every key a
type and make unknown keys errors (OmegaConf struct mode).  Registered with Hydra's ConfigStore
in ``launcher.config.compose``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Union

from omegaconf import MISSING

from launcher.contract import STAGE_ORDER  # noqa: F401  (the stage names are the contract's)
from launcher.contract import (
    BaselineMode, Device, Dispatcher, OnUnsupported, ShardMode, VllmMode, VllmScoring, values)
from launcher.formats import FormatName

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

    name: str = MISSING
    architecture: str = MISSING        # HF `architectures[0]`
    path: str = MISSING                # local HF checkpoint directory (or hub id when online)
    from_checkpoint: bool = False      # fill the dimensions below from path/config.json
    num_layers: int = MISSING
    hidden_size: int = MISSING
    num_attention_heads: int = MISSING
    num_query_groups: int = MISSING
    num_experts: int = 0               # 0: dense
    moe_topk: int = 0
    hybrid_pattern: Optional[str] = None  # e.g. Nemotron-H "MEMEM*E..." (M mamba, E MoE, * attn, - MLP)
    vocab_size: Optional[int] = None
    trust_remote_code: bool = False


@dataclass
class RecipeConfig:
    """A quantization recipe: a named ModelOpt config, a ModelOpt recipe YAML, or none."""

    name: str = MISSING
    format: FormatName = MISSING       # nvfp4 | fp8 | none (launcher/formats.py): what export must contain
    modelopt_cfg: Optional[str] = None  # e.g. NVFP4_DEFAULT_CFG (attribute of modelopt.torch.quantization)
    recipe_path: Optional[str] = None   # a ModelOpt recipe YAML instead of a named config
    exclude_modules: list[str] = field(default_factory=list)  # extra wildcard patterns left unquantized
    quantize_experts: bool = True      # the stage fails if any expert is left unquantized
    description: str = ""


@dataclass
class ParallelConfig:
    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int = 1
    cp: int = 1
    world_size: Optional[int] = None   # default: the smallest world the degrees divide


@dataclass
class ExecutorConfig:
    """What every executor takes; each kind (config group ``executor``) extends it."""

    kind: str = MISSING                # local | slurm
    device: Device = Device.auto       # auto | cpu | cuda
    omp_num_threads: int = 1
    collective_timeout_s: int = 120    # process-group timeout for every stage
    # master_port is each kind's own: a free port here (local), derived from the job id (slurm)


@dataclass
class LocalExecutorConfig(ExecutorConfig):
    kind: str = "local"
    master_port: Optional[int] = None  # default: a free port


@dataclass
class SlurmExecutorConfig(ExecutorConfig):
    kind: str = "slurm"
    partition: Optional[str] = None
    account: Optional[str] = None
    qos: Optional[str] = None
    time: str = "01:00:00"
    nodes: int = 1
    gpus_per_node: int = 0
    cpus_per_task: Optional[int] = None
    mem: Optional[str] = None
    container_image: Optional[str] = None
    container_mounts: list[str] = field(default_factory=list)
    setup: list[str] = field(default_factory=list)  # shell lines run before srun (module load ...)
    python: str = "python"             # interpreter inside the allocation
    env: dict[str, str] = field(default_factory=dict)
    sbatch_args: list[str] = field(default_factory=list)  # extra #SBATCH flags, e.g. ["--exclusive"]
    srun_args: list[str] = field(default_factory=list)    # extra srun flags, e.g. ["--mpi=pmix"]
    poll_interval_s: float = 2.0
    master_port: int = 0               # 0: 20000 + job id % 20000 (jobs sharing a node never collide)


@dataclass
class CalibConfig:
    dataset: str = MISSING             # jsonl (text | messages), .txt, or an HF datasets directory
    size: int = 32
    max_seq_len: int = 4096
    batch_size: int = 1
    text_key: str = "text"


@dataclass
class QuantizeStage:
    enabled: bool = True
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    calib: CalibConfig = field(default_factory=CalibConfig)
    dtype: str = "bfloat16"            # params dtype on GPU; CPU always runs fp32
    moe_dispatcher: Dispatcher = Dispatcher.alltoall


@dataclass
class MmluStage:
    enabled: bool = True
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    dataset: str = MISSING             # HF datasets dir (cais/mmlu layout), CSV dir, jsonl, or hub id
    dev_dataset: Optional[str] = None  # few-shot source when `dataset` holds no dev split
    fraction: float = 1.0
    few_shots: int = 0
    batch_size: Union[int, str] = "auto"   # auto: CUDA - token budget, no row cap; CPU - 8 rows
    max_batch_tokens: Optional[int] = None  # token budget per batch (padded tokens); auto: from the device
    max_seq_len: int = 4096
    add_bos: Optional[bool] = None     # None: as lm-evaluation-harness does for the tokenizer
    lower_bound: Optional[float] = None
    max_drop: Optional[float] = None
    baseline: BaselineMode = BaselineMode.none  # none | recorded | evaluate (or reuse its cache) | cached (cache only)
    baseline_accuracy: Optional[float] = None  # with baseline=recorded
    baseline_cache_dir: Optional[str] = None   # per-question baseline cache (default <cache_dir()>/mmlu_baseline)
    shard_mode: ShardMode = ShardMode.auto  # auto | balanced | lockstep | dense_dp (tests only at EP>1)
    allow_unsafe_shard_mode: bool = False  # test flag: permit dense_dp at EP>1 (reproduces the hang)
    collective_timeout_s: int = 45     # guard + collectives: far below NCCL's 600 s
    moe_dispatcher: Dispatcher = Dispatcher.alltoall


@dataclass
class ExportStage:
    enabled: bool = True
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    name: str = "hf"                   # export/<name>
    dtype: str = "bfloat16"
    overwrite: bool = False
    verify: bool = True
    verify_samples: int = 4            # modules per kind compared against the Megatron weights


@dataclass
class VllmSmokeStage:
    enabled: bool = False
    disabled_reason: str = ""
    # vLLM's own tensor parallelism: the stage is one launcher rank, and vLLM starts this many
    # workers on that rank's node (one GPU each); vLLM has no pipeline or expert degree of ours
    tensor_parallel_size: int = 1
    mode: VllmMode = VllmMode.server   # server | offline
    python: Optional[str] = None       # interpreter with vLLM (default: .venv-vllm, then this one)
    score_choices: bool = True         # score the gate's questions through vLLM, compare with mmlu/results.json
    questions: int = 0                 # how many of the gate's questions (evenly spaced, gate order); 0: all
    scoring: VllmScoring = VllmScoring.prompt_logprobs  # prompt_logprobs | choice_logprobs: how vLLM scores " A".." D"
    min_agreement: Optional[float] = None  # null: 0.99 for an unquantized export, 0.95 for a quantized one
    tie_margin: float = 0.25           # gate top-2 logit margin below which a question is reported, not counted
    min_accuracy: Optional[float] = None   # served accuracy floor; null: the gate's lower_bound (0 without one)
    prompts: Optional[str] = None      # generation checks: jsonl {prompt, contains | expected, chat}
    max_tokens: int = 32               # greedy tokens per generation check
    startup_timeout_s: int = 600
    request_timeout_s: int = 600
    model_dir: Optional[str] = None    # serve this HF directory instead of export/<stages.export.name>
    on_unsupported: OnUnsupported = OnUnsupported.skip  # skip | fail
    force: bool = False                # skip the capability check (vLLM's own refusal is reported)
    extra_args: list[str] = field(default_factory=list)


@dataclass
class Stages:
    quantize: QuantizeStage = field(default_factory=QuantizeStage)
    mmlu: MmluStage = field(default_factory=MmluStage)
    export: ExportStage = field(default_factory=ExportStage)
    vllm_smoke: VllmSmokeStage = field(default_factory=VllmSmokeStage)


@dataclass
class PipelineConfig:
    job_name: str = MISSING
    note: str = ""
    allow_to_fail: bool = False
    test_level: int = 0
    runs_root: str = "runs"
    seed: int = 1234
    model: ModelCard = MISSING
    recipe: RecipeConfig = MISSING
    executor: Any = MISSING            # an ExecutorConfig: LocalExecutorConfig | SlurmExecutorConfig (group `executor`)
    stages: Stages = field(default_factory=Stages)
    env: dict[str, str] = field(default_factory=dict)  # exported to every rank; secrets masked in config.yaml
