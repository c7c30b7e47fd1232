#!/usr/bin/env bash
# The prepared device check of loomrl on one CUDA GPU (docs/gpu.md); at most 8 minutes on an H200.
#   bash tools/gpu_check.sh [OUT_DIR]
# Runs with the machine's own python3 (its CUDA torch) and this checkout on PYTHONPATH. Python
# packages that machine lacks travel as wheels in .whl/ (docs/gpu.md: how to download them) and
# are installed into /tmp/loomrl-site first; nothing is fetched from a network.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${1:-${OUT:-/tmp/gpu_check}}"
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/loomrl-site .whl/*.whl
  export PYTHONPATH="/tmp/loomrl-site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
exec timeout 480 python3 tools/gpu_check.py "$OUT_DIR"
