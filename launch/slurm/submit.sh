#!/usr/bin/env bash
# launch/slurm/submit.sh — submit launch/slurm/run.sbatch with the nodes and GPUs the recipe
# needs (python -m areal_mega.launch.slurm_submit; see its --help).
#
# Usage (from the repository root):
#   launch/slurm/submit.sh [--dry-run] [--partition=gpu ...] recipes/X.yaml [key=value ...]
# PYTHON: default the repository's .venv/bin/python when present, else python3.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
if [[ -z ${PYTHON:-} ]]; then
    if [[ -x $root/.venv/bin/python ]]; then PYTHON=$root/.venv/bin/python; else PYTHON=python3; fi
fi
export PYTHON
exec "$PYTHON" -m areal_mega.launch.slurm_submit "$@"
