#!/usr/bin/env bash
# GPU call (2 GPUs of one host): where gradient release's memory and time go.
#  1. The GPU tests of release (one GPU; TESTS overrides) and FSDP2 + DCP resume (two GPUs).
#  2. FSDP2, Llama-3-8B shape, batch 1 x S per rank for S in FSDP_SEQS: the lean preset without and
#     with release, and the floor (none-bf16: no optimizer, each sharded gradient dropped after its
#     reduce-scatter), one configuration per process, with per-phase peaks (tools/fsdp_bench.py).
#  3. 0.95B end to end (GPU 0), E2E_RUNS runs of E2E_ROWS with --clip-all (every optstate row clips
#     at 1.0; OLD: a folder with an earlier optstate_core for the even runs; E2E_STEPS), then chrome traces of TRACE_ROWS (summaries beside them).
# Results under $OUT ('+' in file names becomes '_').
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:$PWD/integrations${PYTHONPATH:+:$PYTHONPATH}" NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
CUDA_VISIBLE_DEVICES=0 timeout 200 python3 -m pytest -q -p no:cacheprovider ${TESTS:-tests/test_release.py \
  tests/gpu/test_release_offload.py tests/test_master_tier.py tests/gpu/test_prefetch_cuda.py \
  "tests/gpu/test_cuda.py::test_released_backward_never_syncs" tests/gpu/test_resume_fused.py} > "$OUT/tests.txt" 2>&1
tail -1 "$OUT/tests.txt"; grep -E "^E  |^FAILED" "$OUT/tests.txt" | head -12
if [ -z "${SKIP_FSDP_RESUME:-}" ]; then
  timeout 110 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_fsdp_resume.py > "$OUT/fsdp_resume.txt" 2>&1
  tail -1 "$OUT/fsdp_resume.txt"
fi
for seq in ${FSDP_SEQS-2048}; do
  for rows in ${FSDP_ROWS:-bf16w-4bit-lean+norelease bf16w-4bit-lean none-bf16}; do
    timeout 130 torchrun --nproc_per_node 2 tools/fsdp_bench.py --steps 4 --warmup 2 --model ${FSDP_MODEL:-8b} \
      --batch 1 --seq $seq --optimizers "$rows" > "$OUT/fsdp_${seq}_${rows//+/_}.txt" 2>&1
    echo "seq $seq rc $? $(date -u +%T) $(grep "^| $rows" "$OUT/fsdp_${seq}_${rows//+/_}.txt")"
  done
done
ROOT=$PWD
for run in $(seq ${E2E_RUNS:-2}); do
  # a baseline tree (OLD=<folder holding an earlier optstate_core>) for the even runs, same machine
  if [ -n "${OLD:-}" ] && [ $((run % 2)) = 0 ]; then dir="$ROOT/$OLD"; else dir="$ROOT"; fi
  (cd "$dir" && CUDA_VISIBLE_DEVICES=0 timeout 240 python3 -m optstate_core bench --e2e --clip-all --steps ${E2E_STEPS:-10} --warmup 3 \
    --optimizers ${E2E_ROWS:-adamw,8bit+norelease,8bit+release,bf16w-8bit+norelease,bf16w-8bit,bf16w-4bit-lean+norelease,bf16w-4bit-lean} \
    > "$OUT/e2e_$run.txt" 2>&1)
  echo "e2e run $run rc $? $(date -u +%T) $(cd "$dir" && python3 -c 'import optstate_core; print(optstate_core.__file__)')"
  grep "^|" "$OUT/e2e_$run.txt"
done
if [ -n "${TRACE_ROWS:-}" ]; then
  CUDA_VISIBLE_DEVICES=0 timeout 150 python3 -m optstate_core bench --e2e --clip-all --steps 3 --warmup 3 \
    --optimizers "$TRACE_ROWS" --trace "$OUT/tr" > "$OUT/trace_run.txt" 2>&1
  for t in "$OUT"/tr/*.json; do
    python3 tools/trace_timeline.py "$t" --cpu-ops bwd > "${t%.json}.timeline.txt" 2>&1
    gzip -q "$t"
  done
  for f in "$OUT"/tr/*; do [[ "$f" == *+* ]] && mv "$f" "${f//+/_}"; done
fi
true
