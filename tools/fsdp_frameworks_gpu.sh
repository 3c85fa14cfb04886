#!/usr/bin/env bash
# FSDP2 through Accelerate's plugin, the HF Trainer and Lightning's ModelParallelStrategy on 2 GPUs
# (NCCL): trains, checks per-rank state and a bit-identical resume from each framework's checkpoint.
# Run from the repository root on a machine with 2+ GPUs and the project installed (pip install -e ".[dev]"):
#     bash tools/fsdp_frameworks_gpu.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES:-0,1}"
python -m pytest -m gpu -v tests/gpu/test_fsdp_frameworks.py "$@"
