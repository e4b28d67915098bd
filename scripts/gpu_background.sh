#!/usr/bin/env bash
# gpu_checks.sh parts as background jobs on the lent GPU host, so that the calls which carry the rest
# of a payload (64 MiB per call: the vLLM wheelhouse, SmolLM2's wheel) overlap with GPU work.
#
# A process in its own session (setsid) outlives the call that started it, for as long as the host
# stays warm (30 s after a call; the next call must come sooner).  Each job runs from its own copy of
# the repo (the next call replaces the working tree; its ignored paths vanish unless carried again),
# without the carried wheels (/tmp/site is installed once, by the first call's gpu_checks.sh).
#
#   bash scripts/gpu_background.sh start NAME [--after JOB]... [--needs FILE]... [VAR=VALUE]... -- PART...
#        queue gpu_checks.sh PART... as job NAME: it starts once every JOB has ended and every FILE
#        exists; its report lands in /tmp/gpu-bg/NAME/out, its console in /tmp/gpu-bg/NAME/console.log,
#        its exit status in /tmp/gpu-bg/NAME/exit
#   bash scripts/gpu_background.sh status            every job: waiting, running or its exit, and its last lines
#   bash scripts/gpu_background.sh wait SECONDS      until every job has ended, or SECONDS passed (exit 1 then)
#   bash scripts/gpu_background.sh collect DIR       each job's report folder as DIR/bg-NAME.tgz (one file a job:
#                                                    a device call returns at most 8)
set -uo pipefail
BG=/tmp/gpu-bg
root=$(cd "$(dirname "$0")/.." && pwd)
cmd=${1:?usage: gpu_background.sh start|status|wait|collect ...}
shift
case $cmd in
  start)
    name=${1:?job name}; shift
    after=(); needs=(); envs=()
    while [ $# -gt 0 ] && [ "$1" != "--" ]; do
      case $1 in
        --after) after+=("$2"); shift 2 ;;
        --needs) needs+=("$2"); shift 2 ;;
        *=*) envs+=("$1"); shift ;;
        *) echo "gpu_background.sh start: unexpected '$1' (VAR=VALUE, --after JOB, --needs FILE, then -- PART...)"; exit 2 ;;
      esac
    done
    [ "${1:-}" = "--" ] || { echo "gpu_background.sh start: give the parts after --"; exit 2; }
    shift
    [ $# -gt 0 ] || { echo "gpu_background.sh start: no parts"; exit 2; }
    job=$BG/$name
    [ -e "$job" ] && { echo "gpu_background.sh: job $name exists ($job)"; exit 2; }
    mkdir -p "$job/out"
    cp -a "$root" "$job/repo" && rm -rf "$job/repo/.whl" "$job/repo/.gpu-parts" "$job/repo/.vllm-wheelhouse"
    {
      printf 'cd %q\n' "$job/repo"
      for a in "${after[@]}"; do printf 'until [ -f %q ]; do sleep 2; done\n' "$BG/$a/exit"; done
      for f in "${needs[@]}"; do printf 'until [ -f %q ]; do sleep 2; done\n' "$f"; done
      printf 'date +%%s > %q\n' "$job/started"
      printf 'env'
      printf ' %q' "${envs[@]}" bash scripts/gpu_checks.sh "$job/out" "$@"
      printf ' > %q 2>&1\necho $? > %q\n' "$job/console.log" "$job/exit"
    } > "$job/job.sh"
    setsid nohup bash "$job/job.sh" > /dev/null 2>&1 < /dev/null &
    echo "[bg] $name queued: gpu_checks.sh $* (after: ${after[*]:-none}; needs: ${needs[*]:-none}; env: ${envs[*]:-none})" ;;
  status)
    for job in "$BG"/*/; do
      [ -d "$job" ] || continue
      name=$(basename "$job")
      if [ -f "$job/exit" ]; then state="exit $(cat "$job/exit")"
      elif [ -f "$job/started" ]; then state="running for $(( $(date +%s) - $(cat "$job/started") )) s"
      else state=waiting; fi
      echo "[bg] $name: $state"
      [ -f "$job/console.log" ] && tail -n "${TAIL_LINES:-4}" "$job/console.log" | sed 's/^/    /'
    done ;;
  wait)
    deadline=$(( $(date +%s) + ${1:?seconds} ))
    while [ "$(date +%s)" -lt "$deadline" ]; do
      pending=0
      for job in "$BG"/*/; do [ -d "$job" ] && [ ! -f "$job/exit" ] && pending=1; done
      [ "$pending" = 0 ] && exit 0
      sleep 5
    done
    exit 1 ;;
  collect)
    dir=${1:?report folder}
    mkdir -p "$dir"
    for job in "$BG"/*/; do
      [ -d "$job/out" ] || continue
      name=$(basename "$job")
      cp "$job/console.log" "$job/out/console.log" 2>/dev/null
      tar -C "$job/out" -czf "$dir/bg-$name.tgz" . && echo "[bg] $name -> $dir/bg-$name.tgz"
    done ;;
  *) echo "gpu_background.sh: unknown command '$cmd' (valid: start status wait collect)"; exit 2 ;;
esac
