#!/usr/bin/env bash
# Debian's Slurm and munge (slurmctld, slurmd, slurm-client, munge), for tests/slurm; a no-op
# when they are there. Needs root, as the Slurm tests do. Nothing is started or enabled here: the
# tests start their own munged, slurmctld and slurmds with configurations of their own.
set -euo pipefail
have() { command -v "$1" >/dev/null 2>&1; }
if have slurmctld && have slurmd && have srun && have sbatch && have munged; then exit 0; fi
export DEBIAN_FRONTEND=noninteractive
apt-get install -y -q slurmctld slurmd slurm-client munge >/dev/null 2>&1 || {
    apt-get update -q >/dev/null 2>&1 || true
    apt-get install -y -q slurmctld slurmd slurm-client munge >/dev/null
}
echo "slurm: $(slurmctld -V)"
