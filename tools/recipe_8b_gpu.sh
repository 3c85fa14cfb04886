#!/usr/bin/env bash
# GPU call (one 80 GB GPU, issue 39): examples/finetune_8b_24gb.py at Llama-3-8B shapes through the
# HF Trainer under a 24 GB cap against the resident preset on the whole card (micro-batch 1 and 2),
# Lightning and Accelerate under the cap, torchao's CPUOffloadOptimizer under the cap; the GPU tests
# of offloaded state; a single-GPU DCP resume of the offloaded preset. Every step time-boxed, under a
# deadline; results under $OUT (rows.jsonl, one log per step).
set -uo pipefail
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=16
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH="/tmp/site:$PWD:$PWD/integrations"
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
START=$SECONDS; DEADLINE=${DEADLINE:-570}
run() {  # run NAME LIMIT CMD...: skipped when the deadline is near
  local name=$1 limit=$2; shift 2
  local left=$((DEADLINE - (SECONDS - START)))
  if [ "$left" -lt 30 ]; then echo "$name skipped (deadline)" >> "$OUT/rc.txt"; return; fi
  [ "$limit" -gt "$left" ] && limit=$left
  timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1; echo "$name rc $? $((SECONDS - START))s" >> "$OUT/rc.txt"
}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$OUT/machine.txt"
E="python3 examples/finetune_8b_24gb.py --json $OUT/rows.jsonl --steps ${STEPS:-6}"
run tests 130 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_release_offload.py tests/gpu/test_resume_fused.py \
  tests/integrations/test_finetune_8b_example.py -m gpu -x
run trainer_cap24_mb1 90 $E --gpu-memory 24GB --micro-batch 1
run trainer_whole_mb1 75 $E --preset bf16w-4bit-lean --micro-batch 1
run trainer_cap24_mb2 90 $E --gpu-memory 24GB --micro-batch 2
run trainer_whole_mb2 75 $E --preset bf16w-4bit-lean --micro-batch 2
run lightning_cap24_mb2 90 $E --gpu-memory 24GB --micro-batch 2 --framework lightning
run accelerate_cap24_mb2 90 $E --gpu-memory 24GB --micro-batch 2 --framework accelerate
run torchao_cap24_mb2 110 python3 examples/finetune_8b_24gb.py --json "$OUT/rows.jsonl" --steps 4 --gpu-memory 24GB \
  --micro-batch 2 --optimizer torchao-offload
run resume_095b_offload 70 torchrun --nproc_per_node 1 tools/fsdp_dcp_resume.py --model 0.95b --checkpoint /tmp/dcp \
  --optimizers bf16w-4bit-lean-offload+release
OPTSTATE_STAGE_AHEAD=0 run resume_095b_offload_nostage 70 torchrun --nproc_per_node 1 tools/fsdp_dcp_resume.py \
  --model 0.95b --checkpoint /tmp/dcp --optimizers bf16w-4bit-lean-offload+release
run trainer_cap32_hostcorr_mb1 75 $E --gpu-memory 32GB --preset bf16w-4bit-lean-hostcorr --micro-batch 1
cat "$OUT/rc.txt"; tail -3 "$OUT/tests.txt"; grep -h "^| trainer\|^| lightning\|^| accelerate" "$OUT"/*.txt
