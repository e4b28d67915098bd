#!/usr/bin/env bash
# Install what tests/slurm_cluster.py needs to run real Slurm clusters (Debian/Ubuntu): slurmctld,
# slurmd, the clients (sbatch, srun, scontrol, squeue, scancel, sinfo), munge, and iproute2's `ip`
# (the two-node cluster puts each slurmd in its own network namespace; nsenter/unshare: util-linux).
# Idempotent: does nothing when every binary is present.  ~10 s, 13 MB.
# The test suite starts its own daemons under a private directory; the system services are not used.
set -euo pipefail
BINS=(munged slurmctld slurmd sbatch srun scontrol squeue scancel sinfo ip)
PKGS=(slurmctld slurmd slurm-client munge iproute2)

have_all() {
    local b
    for b in "${BINS[@]}"; do
        command -v "$b" >/dev/null 2>&1 || [[ -x "/usr/sbin/$b" ]] || return 1
    done
}

if have_all; then
    echo "[install_slurm] already installed: $(dpkg-query -W -f='${Package} ${Version}' slurm-client 2>/dev/null || echo slurm)"
    exit 0
fi
SUDO=""
if [[ "$(id -u)" != 0 ]]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
# wait for another apt (e.g. an operator's, or scripts/install_chromium.sh) instead of failing on its lock
APT=(apt-get -o DPkg::Lock::Timeout=600)
$SUDO "${APT[@]}" update -qq
$SUDO "${APT[@]}" install -y -qq --no-install-recommends "${PKGS[@]}"
# On hosts with systemd the packages start system services (without a slurm.conf they fail anyway);
# stop them so only the test suite's private daemons run.
if command -v systemctl >/dev/null 2>&1 && [[ -d /run/systemd/system ]]; then
    $SUDO systemctl disable --now slurmctld slurmd munge >/dev/null 2>&1 || true
fi
have_all || { echo "[install_slurm] install finished but binaries are missing" >&2; exit 1; }
echo "[install_slurm] installed: $(dpkg-query -W -f='${Package} ${Version}' slurm-client)"
