#!/usr/bin/env bash
# Installs specmesh and what its tests need. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
# The CPU build of torch 2.13.0 lies on disk here; a looser pin would pull a multi-GB CUDA build.
python -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
python -m pip install --quiet --disable-pip-version-check -e ".[test]"
# The AVX-512 CPU kernels (bf16 linear, row ops, attention), compiled once into torch's extension cache (~1 minute).
python -m services.target.kernels.cpu_kernels
