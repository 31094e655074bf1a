#!/usr/bin/env bash
# The prepared device check on a GPU host (docs/gpu-check.md): installs the locked environment
# with JAX's CUDA 12 plugin (the `cuda` extra), then runs every section within 7.5 minutes and
# writes the JSON (default gpu_check.json in the repository root). Extra arguments go to
# benchmarks/gpu_check.py (e.g. --budget-s 600, --proof-mode both).
# With the conda environment instead (envs/minifield-gpu.yaml, activated):
#   python benchmarks/gpu_check.py --out gpu_check.json
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-gpu_check.json}"
shift || true
uv sync --locked --extra cuda
exec uv run --locked --extra cuda python benchmarks/gpu_check.py --out "$out" "$@"
