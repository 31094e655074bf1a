#!/usr/bin/env bash
# Run by Snakemake (--sdm conda) inside the freshly created environment: install this
# project (the repository two levels up from this file) without touching the pinned
# dependencies from minifield-gpu.yaml. Editable, so the rules run the checked-out code.
set -euo pipefail
pip install --no-deps --editable "$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
