#!/usr/bin/env bash
# GPU call (4 GPUs, issue 40), after tools/fsdp70b_gpu.sh: the 70B offloaded row again (pinned slabs),
# FSDP2 + DCP resume of Llama-3-8B shapes on every GPU, and 8B rows beside torch FSDP2's own
# CPUOffloadPolicy (AdamW on the CPU) at the 70B rows' batch. Results under $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:$PWD/integrations" OMP_NUM_THREADS=8
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
N=$(nvidia-smi -L | wc -l)
B="torchrun --nproc_per_node $N tools/fsdp_bench.py --batch 1 --seq 4096 --warmup 2"
run() { local name=$1 limit=$2; shift 2; timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1; echo "$name rc $?" >> "$OUT/rc.txt"; }
run 70b_offload 170 $B --model 70b --steps 8 --optimizers bf16w-4bit-lean-offload --json "$OUT/rows.jsonl"
run dcp_8b 160 torchrun --nproc_per_node $N tools/fsdp_dcp_resume.py --model 8b --checkpoint /tmp/dcp \
  --optimizers bf16w-4bit-lean+release,bf16w-4bit-lean-offload+release
for opt in none-bf16 bf16w-4bit-lean-offload fsdp-cpu-offload; do
  run "8b_$opt" 110 $B --model 8b --steps 5 --optimizers "$opt" --json "$OUT/rows.jsonl"
done
cat "$OUT/rc.txt"; grep -h "^ROW" "$OUT"/dcp_8b.txt | cut -c1-400
