#!/usr/bin/env bash
# Second GPU call: tests, kernel profile, tuning sweep, then the full step table.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:$PWD/integrations"
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH="$PYTHONPATH:/tmp/site"
timeout 240 python3 -m pytest -q tests/gpu tests/kernels -p no:cacheprovider 2>&1 | tail -4
for p in "8bit --nocheck" "4bit --nocheck" "8bit"; do timeout 120 python3 tools/profile_step.py --preset $p 2>&1 | grep -v "^-\|Self CPU" | head -14; done
B="python3 -m optstate_core.bench --steps 10 --warmup 3"
timeout 200 $B --configs adamw,int8_nocheck,4bit_nocheck --tune 2x4,4x4,4x8,8x8 2>&1 | grep "^|"
OPTSTATE_FAST_MATH=1 timeout 120 $B --configs adamw,int8_nocheck,4bit_nocheck --tune 2x4,4x8 2>&1 | grep "^|"
timeout 400 $B --compare --configs adamw,fp32,fp32_nocheck,bf16,int8,int8_nocheck,4bit,4bit_nocheck,bnb8,ao8,ao4 --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.txt" | grep -v "^bench:"
