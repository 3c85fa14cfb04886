#!/usr/bin/env bash
# GPU call (4 GPUs, issue 40): Llama-3-8B shapes fully fine-tuned through the HF Trainer's and
# Accelerate's FSDP2 (examples/finetune_8b_24gb.py under torchrun, bf16w-4bit-lean-offload + release,
# 1 x 4096 per rank), the 8B offloaded DCP resume without state staged ahead (OPTSTATE_STAGE_AHEAD=0),
# and the 70B offloaded row with fast pinning. Every step time-boxed under a deadline, orphans killed
# between steps; results under $OUT: log.txt, rows.jsonl, rc.txt. STEPS_LIST picks steps.
set -uo pipefail
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=8 PYTHONPATH="$PWD:$PWD/integrations"
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; LOG="$OUT/log.txt"
START=$SECONDS; DEADLINE=${DEADLINE:-560}
N=$(nvidia-smi -L | wc -l)
run() {  # run NAME LIMIT CMD...: skipped when the deadline is near; its output's tail appended to log.txt
  local name=$1 limit=$2; shift 2
  local left=$((DEADLINE - (SECONDS - START)))
  if [ "$left" -lt 25 ]; then echo "$name skipped (deadline)" >> "$OUT/rc.txt"; return; fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "=== $name" >> "$LOG"
  timeout -k 5 "$limit" "$@" > "$OUT/step.txt" 2>&1; local rc=$?
  if [ $rc -eq 0 ]; then grep -v "^{'\|Warning\|warn" "$OUT/step.txt" | tail -12 >> "$LOG"; else tail -40 "$OUT/step.txt" >> "$LOG"; fi
  echo "$name rc $rc $((SECONDS - START))s" >> "$OUT/rc.txt"
  pkill -9 -f finetune_8b_24gb.py; pkill -9 -f fsdp_dcp_resume; pkill -9 -f fsdp_bench; pkill -9 -f torchrun; sleep 2
}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$OUT/rc.txt"
E="torchrun --nproc_per_node $N examples/finetune_8b_24gb.py --json $OUT/rows.jsonl --seq 4096 --micro-batch 1 --steps 6"
for step in ${STEPS_LIST:-trainer accelerate dcp_ahead0 70b}; do case $step in
trainer) run trainer_fsdp2_8b 150 $E --framework trainer ;;
accelerate) run accelerate_fsdp2_8b 150 $E --framework accelerate ;;
dcp_ahead0) run dcp_8b_offload_ahead0 170 env OPTSTATE_STAGE_AHEAD=0 torchrun --nproc_per_node $N \
  tools/fsdp_dcp_resume.py --model 8b --checkpoint /tmp/dcp --optimizers bf16w-4bit-lean-offload+release ;;
70b) run 70b_offload 200 torchrun --nproc_per_node $N tools/fsdp_bench.py --batch 1 --seq 4096 --warmup 2 \
  --model 70b --steps 6 --optimizers bf16w-4bit-lean-offload --json "$OUT/rows.jsonl" ;;
esac; done
rm -f "$OUT/step.txt"; cat "$OUT/rc.txt"; grep -h "^| \|^ROW" "$LOG" | cut -c1-300
