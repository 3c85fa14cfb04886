#!/usr/bin/env bash
# Third GPU call: the GPU tests, then a tuning sweep of the fused kernels, then the step table.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:$PWD/integrations"
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 240 python3 -m pytest -q tests/gpu tests/kernels -p no:cacheprovider 2>&1 > "$OUT/gpu_tests.txt"; tail -3 "$OUT/gpu_tests.txt"
grep -B5 -A40 "^___" "$OUT/gpu_tests.txt" | grep -E "^E|^___|assert" | head -30
timeout 60 python3 tools/profile_step.py --preset 8bit --nocheck 2>&1 | grep -E "host|adam_kernel"
timeout 60 python3 tools/profile_step.py --preset 4bit --nocheck 2>&1 | grep -E "host|adam_kernel"
B="python3 -m optstate_core.bench --steps 10 --warmup 3"
timeout 240 $B --configs adamw,int8_nocheck,4bit_nocheck,bf16 --tune 4x4,8x8,8x4,16x8,2x2 2>&1 | grep "^|"
