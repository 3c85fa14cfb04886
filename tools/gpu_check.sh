#!/usr/bin/env bash
# One call on a lent GPU: environment, GPU tests, kernel tests on CUDA, then the step benchmark.
# Usage (device tool): bash tools/gpu_check.sh [bench args...]
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:$PWD/integrations${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/env.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/env.txt"
timeout 300 python3 -m pytest -q -x tests/gpu tests/kernels -p no:cacheprovider 2>&1 | tail -15 | tee "$OUT/gpu_tests.txt"
python3 -m optstate_core.bench --steps 10 --warmup 3 --compare --json "$OUT/bench.json" \
  --configs "${BENCH_CONFIGS:-adamw,fp32,fp32_nocheck,bf16,int8,int8_nocheck,4bit,4bit_nocheck,bnb8,ao8,ao4}" \
  ${BENCH_TUNE:+--tune $BENCH_TUNE} 2>&1 | tee "$OUT/bench.txt" | grep -v "^bench:"
