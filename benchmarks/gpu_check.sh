#!/usr/bin/env bash
# The prepared device check on a GPU host (docs/device-check.md): installs the locked environment
# with JAX's CUDA 12 plugin (the `cuda` extra), then runs the sections within 9 minutes (--budget-s) and
# writes the JSON (default gpu_check.json in the repository root). Extra arguments go to
# benchmarks/device_check (e.g. --budget-s 600, --proof-mode both).
# With the conda environment instead (envs/minifield-gpu.yaml, activated):
#   python benchmarks/device_check --out gpu_check.json
#
# On a host that reaches no package index and brings its own Python 3.12 and JAX (no uv, no
# snakemake, no jsonschema), with a wheel folder made by benchmarks/gpu_offline_wheels.sh:
#   benchmarks/gpu_check.sh --offline WHEELS [OUT.json] [ARGS...]
# installs those wheels (pip --no-index: never the network) into work/gpu-check-site and runs
# the check on that interpreter ($PYTHON, default python3) with PYTHONPATH=src:work/gpu-check-site.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--offline" ]; then
    wheels="${2:?--offline needs the wheel folder (benchmarks/gpu_offline_wheels.sh)}"
    shift 2
    out="${1:-gpu_check.json}"
    shift || true
    python="${PYTHON:-python3}"
    site="$PWD/work/gpu-check-site"
    rm -rf "$site"
    "$python" -m pip install --quiet --disable-pip-version-check --no-index --no-deps \
        --target "$site" "$wheels"/*.whl
    export PYTHONPATH="$PWD/src:$site${PYTHONPATH:+:$PYTHONPATH}"
    exec "$python" benchmarks/device_check --out "$out" "$@"
fi
out="${1:-gpu_check.json}"
shift || true
uv sync --locked --extra cuda
exec uv run --locked --extra cuda python benchmarks/device_check --out "$out" "$@"
