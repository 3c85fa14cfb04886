#!/usr/bin/env bash
# GPU call: tests (kernels, offload), the step table with offload rows, the end-to-end table.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:$PWD/integrations"
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH="$PYTHONPATH:/tmp/site"
timeout 200 python3 -m pytest -q tests/gpu tests/kernels -p no:cacheprovider > "$OUT/gpu_tests.txt" 2>&1; tail -2 "$OUT/gpu_tests.txt"
grep -E "^E  |^FAILED" "$OUT/gpu_tests.txt" | head -12
B="python3 -m optstate_core bench --steps 10 --warmup 3"
timeout 260 $B --compare --json "$OUT/bench.json" \
  --configs adamw,fp32,fp32_nocheck,bf16,int8,int8_nocheck,4bit,4bit_nocheck,int8_offload,fp32_offload,bnb8,ao8,ao4 \
  2>&1 | tee "$OUT/bench.txt" | grep -v "^bench:"
timeout 240 $B --e2e --compare --steps 8 --warmup 3 2>&1 | tee "$OUT/e2e.txt" | grep -v "^e2e:"
