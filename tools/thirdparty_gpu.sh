#!/usr/bin/env bash
# One device call for the third-party optimizers (issue 38): install the carried wheels, run the Lion
# kernel and any-optimizer tests on the GPU, then time the step of Lion and schedule-free AdamW,
# unwrapped and wrapped, against torch's fused AdamW on 1.26B parameters in Llama-1B shapes, in
# two passes (each row's median over its steps; compare the passes). Logs go to $OUT.
set -u
OUT=${OUT:-.out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:.:integrations || exit 1
nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/gpu.txt"
git rev-parse HEAD >> "$OUT/gpu.txt" 2>/dev/null
TESTS=${TESTS:-tests/kernels/test_fused_step.py tests/test_any_optimizer.py tests/gpu/test_cuda.py tests/gpu/test_torch_fused_exact.py}
timeout 300 python3 -m pytest -q -p no:cacheprovider $TESTS 2>&1 | tail -15 > "$OUT/tests.txt"
CONFIGS=${CONFIGS:-adamw,lion,lion_triton,lion_fp32,lion_8bit,lion_4bit,sf,sf_fp32,sf_8bit,sf_8bit_it24,sf_4bit_it24}
for pass in ${PASSES:-1 2}; do
  timeout 200 python3 -m optstate_core bench --configs $CONFIGS --steps 10 --warmup 3 \
    --json "$OUT/step$pass.json" > "$OUT/step$pass.txt" 2>&1
done
cat "$OUT/tests.txt" "$OUT"/step*.txt | grep -v "^bench:"
