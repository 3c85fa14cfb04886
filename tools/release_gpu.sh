#!/usr/bin/env bash
# GPU call (one GPU): gradient release on its side stream, the offload presets, an 8B model under a
# 24 GB cap. Tests first, then the 8B rows (resident, then capped), then the 0.95B end-to-end table
# with the side stream on and off. Results under $OUT; every step has its own timeout.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:$PWD/integrations"
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH="$PYTHONPATH:/tmp/site"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_release_stream.py tests/test_master_tier.py \
  "tests/gpu/test_cuda.py::test_released_backward_never_syncs" > "$OUT/tests.txt" 2>&1; tail -2 "$OUT/tests.txt"
grep -E "^E  |^FAILED" "$OUT/tests.txt" | head -12
P="python3 -m optstate_core bench --peak-bytes --models 8b --steps ${PB_STEPS:-3}"
timeout 130 $P --optimizers bf16w-4bit-lean 2>&1 | tee "$OUT/pb8b_resident.txt" | grep "^|"
timeout 150 $P --memory-cap 24GB --optimizers ${CAPPED:-bf16w-4bit-lean-offload} 2>&1 | tee "$OUT/pb8b_cap24.txt" | grep "^|"
E="python3 -m optstate_core bench --e2e --steps 8 --warmup 3"
timeout 130 $E --optimizers ${E2E:-adamw,8bit,8bit+release,bf16w-4bit-lean+norelease,bf16w-4bit-lean,bf16w-4bit-lean-hostcorr,bf16w-4bit-lean-offload,flashoptim+release} \
  2>&1 | tee "$OUT/e2e_side.txt" | grep "^|"
OPTSTATE_RELEASE_STREAM=0 timeout 90 $E --optimizers adamw,8bit+release,bf16w-4bit-lean,bf16w-4bit-lean-hostcorr \
  2>&1 | tee "$OUT/e2e_inline.txt" | grep "^|"
