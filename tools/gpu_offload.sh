#!/usr/bin/env bash
# GPU call: offload tests, offload rows of the step table, the end-to-end table.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:$PWD/integrations"
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH="$PYTHONPATH:/tmp/site"
timeout 200 python3 -m pytest -q tests/gpu tests/kernels -p no:cacheprovider > "$OUT/gpu_tests.txt" 2>&1; tail -1 "$OUT/gpu_tests.txt"
grep -E "^E  |^FAILED" "$OUT/gpu_tests.txt" | head -12
python3 tools/duplex_bandwidth.py
B="python3 -m optstate_core bench --steps 10 --warmup 3"
timeout 200 $B --configs adamw,int8,int8_offload,fp32_offload 2>&1 | tee "$OUT/bench.txt" | grep "^|"
timeout 240 $B --e2e --compare --steps 8 --warmup 3 2>&1 | tee "$OUT/e2e.txt" | grep -v "^e2e:"
