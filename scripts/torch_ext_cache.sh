#!/usr/bin/env bash
# ModelOpt's JIT CUDA extensions (the FP8 fake quant), built once and carried to a fresh GPU host:
#
#   bash scripts/torch_ext_cache.sh pack   EXT_DIR TGZ   # stamp the build with ModelOpt's version, archive it
#   bash scripts/torch_ext_cache.sh unpack TGZ EXT_DIR   # unpack it where torch builds (TORCH_EXTENSIONS_DIR)
#
# torch runs ninja at every load, and ninja rebuilds an output whose source is newer than the
# output's entry in .ninja_log. On a fresh host pip has just written ModelOpt's kernel sources with
# the current time, so a carried build was rebuilt anyway (49 s on an H100, 2026-12-07; extracting
# with new times, `tar -m`, does not help). `unpack` therefore dates ModelOpt's kernel sources back,
# but only where the build's stamp names the installed ModelOpt version: other sources are rebuilt.
#
# ModelOpt's version and its kernel sources come from `python3` (find_spec: no import);
# MODELOPT_VERSION and MODELOPT_KERNELS set them instead (tests).
set -euo pipefail
verb=${1:?usage: torch_ext_cache.sh pack EXT_DIR TGZ | unpack TGZ EXT_DIR}

modelopt_version() {
  [ -n "${MODELOPT_VERSION:-}" ] && { echo "$MODELOPT_VERSION"; return; }
  python3 -c "import importlib.metadata as m; print(m.version('nvidia-modelopt'))" 2>/dev/null || true
}
modelopt_kernels() {
  [ -n "${MODELOPT_KERNELS:-}" ] && { echo "$MODELOPT_KERNELS"; return; }
  python3 -c "import importlib.util as u, os; print(os.path.join(u.find_spec('modelopt').submodule_search_locations[0], 'torch', 'kernels'))" 2>/dev/null || true
}

case $verb in
  pack)
    ext=${2:?EXT_DIR}; tgz=${3:?TGZ}
    [ -n "$(ls -A "$ext" 2>/dev/null)" ] || { echo "[torch_ext] nothing built in $ext"; exit 0; }
    version=$(modelopt_version)
    if [ -n "$version" ]; then echo "$version" > "$ext/modelopt.version"; fi
    tar -C "$ext" -czf "$tgz" .
    echo "[torch_ext] packed $ext (ModelOpt ${version:-unknown}) into $tgz" ;;
  unpack)
    tgz=${2:?TGZ}; ext=${3:?EXT_DIR}
    mkdir -p "$ext"
    tar -C "$ext" -xzf "$tgz"
    version=$(modelopt_version); kernels=$(modelopt_kernels)
    stamp=$(cat "$ext/modelopt.version" 2>/dev/null || true)
    if [ -n "$version" ] && [ "$stamp" = "$version" ] && [ -d "$kernels" ]; then
      find "$kernels" -type f \( -name "*.cu" -o -name "*.cuh" -o -name "*.cpp" -o -name "*.h" \) \
        -exec touch -d @946684800 {} +
      echo "[torch_ext] the carried build of ModelOpt $version is reused (its kernel sources dated back)"
    else
      echo "[torch_ext] the carried build is of ModelOpt '${stamp:-unstamped}', this is '${version:-none}': ninja rebuilds what changed"
    fi ;;
  *) echo "torch_ext_cache.sh: unknown verb '$verb' (valid: pack, unpack)" >&2; exit 2 ;;
esac
