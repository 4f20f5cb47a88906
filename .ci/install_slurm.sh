#!/bin/sh
# Slurm 22.05 + munge from Debian 12 for the `slurm` tests (idempotent; the test fixture starts the
# daemons itself, under a temporary directory, so nothing is configured or started here).
set -eu
if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null \
   && command -v munged >/dev/null; then
  echo "slurm and munge already installed: $(slurmd -V 2>/dev/null || true)"
  exit 0
fi
SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
$SUDO apt-get update -q
# The packages try to start their services; a policy-rc.d refusal there is harmless.
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends \
  slurmctld slurmd slurm-client munge
slurmd -V
