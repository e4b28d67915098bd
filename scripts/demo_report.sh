#!/usr/bin/env bash
# `make demo-report`: real runs of the tiny Qwen3-MoE example into one runs root, then `launch report`.
#
#   bash scripts/demo_report.sh [RUNS_ROOT]     (default runs/demo-report; `launch` must be on PATH)
#
# Seven runs, each a full pipeline on this CPU machine (quantize at EP4, the paired MMLU gate at EP4
# against the evaluated baseline, export at PP4; the vLLM smoke is off), about 3-5 min each:
#   nightly `launch suite` runs of the NVFP4 example (job tiny-qwen3-moe-nvfp4):
#     1. lower_bound 0.85, max_drop 0.05              2. lower_bound 0.90, max_drop 0.03
#     3. lower_bound 0.995: the gate fails (exit 3; export not run)
#     4. lower_bound 0.90, max_drop 0.02, calibration on 4 samples
#   plain `launch CONFIG --history` runs:
#     5. FP8 (job tiny-qwen3-moe-fp8), lower_bound 0.90   6. FP8, fraction 0.5, lower_bound 0.88
#   7. an interrupted run: NVFP4, killed (SIGKILL: the launcher, its stage agent and every rank)
#      during its quantize stage; it has no history line - `launch report --rebuild-history` finds
#      its run directory.
# Runs already in RUNS_ROOT are kept: a second call adds seven more.
set -uo pipefail
ROOT=${1:-runs/demo-report}
EX=examples/tiny/Qwen3-MoE-tiny/megatron_lm_ptq.yaml
COMMON=(stages.vllm_smoke.enabled=false stages.mmlu.baseline=evaluate)
mkdir -p "$ROOT"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

suite_night() {   # one nightly suite over the NVFP4 example, with these overrides
    echo "[demo-report] suite: $*"
    launch suite examples/tiny/Qwen3-MoE-tiny --runs-root "$ROOT" --junit "$ROOT/junit-$(date +%H%M%S).xml" \
        "${COMMON[@]}" "$@" || echo "[demo-report] (suite exit $?: expected for the failed gate)"
}

plain_run() {
    echo "[demo-report] launch: $*"
    launch "$EX" --history --runs-root "$ROOT" "${COMMON[@]}" "$@" || echo "[demo-report] (launch exit $?)"
}

suite_night stages.mmlu.lower_bound=0.85 stages.mmlu.max_drop=0.05
suite_night stages.mmlu.lower_bound=0.9 stages.mmlu.max_drop=0.03
suite_night stages.mmlu.lower_bound=0.995 stages.mmlu.max_drop=0.05
suite_night stages.mmlu.lower_bound=0.9 stages.mmlu.max_drop=0.02 stages.quantize.calib.size=4
plain_run job_name=tiny-qwen3-moe-fp8 recipe=fp8_default stages.mmlu.lower_bound=0.9 stages.mmlu.max_drop=0.05
plain_run job_name=tiny-qwen3-moe-fp8 recipe=fp8_default stages.mmlu.fraction=0.5 stages.mmlu.lower_bound=0.88 \
    stages.mmlu.max_drop=0.05

echo "[demo-report] an interrupted run: killed during quantize"
MARK="$ROOT/.interrupt-mark"
touch "$MARK"
sleep 1
setsid launch "$EX" --history --runs-root "$ROOT" "${COMMON[@]}" stages.mmlu.max_drop=0.05 &
LAUNCH=$!
for _ in $(seq 1 150); do   # wait until this run's quantize ranks write their log, then a little more
    sleep 2
    if [[ -n "$(find "$ROOT" -path '*/quantize/log.txt' -newer "$MARK" -size +0 2>/dev/null)" ]]; then
        sleep 20
        break
    fi
done
# the local executor starts each stage in a session of its own, and torch's agent each rank in
# another: freeze the whole tree first (nothing new starts), then kill every process of it
descendants() { local p; for p in $(pgrep -P "$1"); do echo "$p"; descendants "$p"; done; }
TREE="$LAUNCH $(descendants "$LAUNCH" | tr '\n' ' ')"
kill -STOP $TREE 2>/dev/null || true
kill -KILL $TREE 2>/dev/null || true
wait "$LAUNCH" 2>/dev/null || true
rm -f "$MARK"

launch report "$ROOT" --rebuild-history
echo "[demo-report] open $ROOT/report/index.html"
