#!/usr/bin/env bash
# Install headless Chromium (Debian's `chromium` package, /usr/bin/chromium) for the browser test of
# `launch report` (tests/test_report_browser.py).  Idempotent: does nothing when chromium is present.
# The test runs it with a fresh --user-data-dir and the flags that keep it off the network
# (tests/test_report_browser.py, CHROMIUM_FLAGS); no service is started.
set -euo pipefail

find_chromium() {
    local b
    for b in chromium chromium-browser; do
        command -v "$b" >/dev/null 2>&1 && { command -v "$b"; return 0; }
    done
    return 1
}

if bin=$(find_chromium); then
    echo "[install_chromium] already installed: $("$bin" --version 2>/dev/null || echo "$bin")"
    exit 0
fi
SUDO=""
if [[ "$(id -u)" != 0 ]]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
# wait for another apt (e.g. scripts/install_slurm.sh run alongside) instead of failing on its lock
APT=(apt-get -o DPkg::Lock::Timeout=600)
$SUDO "${APT[@]}" update -qq
$SUDO "${APT[@]}" install -y -qq --no-install-recommends chromium fonts-dejavu-core
bin=$(find_chromium) || { echo "[install_chromium] install finished but chromium is missing" >&2; exit 1; }
echo "[install_chromium] installed: $("$bin" --version 2>/dev/null || echo "$bin")"
