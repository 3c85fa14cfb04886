#!/usr/bin/env bash
# GPU call (one 80 GB GPU): a Llama-3-8B-shaped model (batch 1 x 2048, activation checkpointing)
# under a 24 GB cap (set_per_process_memory_fraction) against the resident preset on the whole
# card, same call; then gradient accumulation 8 under the cap; then the GPU tests of release over
# streamed state. Results under $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:$PWD/integrations"
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
P="python3 -m optstate_core bench --peak-bytes --models 8b --steps ${PB_STEPS:-3}"
timeout 200 $P --memory-cap 24GB --json "$OUT/cap24.json" \
  --optimizers ${CAPPED:-bf16w-4bit-lean-offload,bf16w-4bit-lean+budget2GiB} \
  2>&1 | tee "$OUT/cap24.txt" | grep "^|"
timeout 160 $P --json "$OUT/whole.json" --optimizers ${WHOLE:-bf16w-4bit-lean,bf16w-4bit-lean-offload} \
  2>&1 | tee "$OUT/whole.txt" | grep "^|"
timeout 150 python3 -m optstate_core bench --peak-bytes --models 8b --steps 2 --accumulate 8 --memory-cap 24GB \
  --json "$OUT/cap24_acc8.json" --optimizers bf16w-4bit-lean-offload 2>&1 | tee "$OUT/cap24_acc8.txt" | grep "^|"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_release_offload.py tests/test_master_tier.py \
  "tests/gpu/test_cuda.py::test_released_backward_never_syncs" tests/gpu/test_resume_fused.py > "$OUT/tests.txt" 2>&1
tail -2 "$OUT/tests.txt"; grep -E "^E  |^FAILED" "$OUT/tests.txt" | head -12
