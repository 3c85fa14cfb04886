#!/usr/bin/env bash
# GPU call (4 GPUs, issue 40): Llama-3-8B shapes fully fine-tuned through the HF Trainer's and
# Accelerate's FSDP2 (examples/finetune_8b_24gb.py under torchrun, bf16w-4bit-lean-offload + release,
# 1 x 4096 per rank), the 8B offloaded DCP resume (also without state staged ahead: dcp_ahead0),
# and the 70B offloaded row with fast pinning. Every step time-boxed under a deadline, orphans killed
# between steps; results under $OUT: log.txt, rows.jsonl, rc.txt. STEPS_LIST picks steps.
set -uo pipefail
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=8 PYTHONPATH="$PWD:$PWD/integrations"
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; LOG="$OUT/log.txt"
START=$SECONDS; TAIL_OK=12; source tools/gpu_call_lib.sh
N=$(nvidia-smi -L | wc -l)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$OUT/rc.txt"
E="torchrun --nproc_per_node $N examples/finetune_8b_24gb.py --json $OUT/rows.jsonl --seq 4096 --micro-batch 1 --steps 6"
for step in ${STEPS_LIST:-trainer accelerate dcp 70b}; do case $step in
trainer) run trainer_fsdp2_8b 150 $E --framework trainer ;;
accelerate) run accelerate_fsdp2_8b 150 $E --framework accelerate ;;
dcp) run dcp_8b_offload 170 torchrun --nproc_per_node $N tools/fsdp_dcp_resume.py --model 8b --checkpoint /tmp/dcp \
  --optimizers bf16w-4bit-lean-offload+release ;;
dcp_ahead0) run dcp_8b_offload_ahead0 170 env OPTSTATE_STAGE_AHEAD=0 torchrun --nproc_per_node $N \
  tools/fsdp_dcp_resume.py --model 8b --checkpoint /tmp/dcp --optimizers bf16w-4bit-lean-offload+release ;;
70b) run 70b_offload 200 torchrun --nproc_per_node $N tools/fsdp_bench.py --batch 1 --seq 4096 --warmup 2 \
  --model 70b --steps 6 --optimizers bf16w-4bit-lean-offload --json "$OUT/rows.jsonl" ;;
esac; done
rm -f "$OUT/step.txt"; cat "$OUT/rc.txt"; grep -h "^| \|^ROW" "$LOG" | cut -c1-300
