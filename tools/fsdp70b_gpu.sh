#!/usr/bin/env bash
# GPU call (4 GPUs, issue 40): Llama-3-70B shapes under FSDP2 through tools/fsdp_bench.py, one
# configuration per torchrun (the no-optimizer floor, the offloaded lean preset, the lean preset
# under a gpu_budget), batch 1 x 4096 per rank, 10 iterations on a repeated batch. Results under $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:$PWD/integrations" OMP_NUM_THREADS=8
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
N=$(nvidia-smi -L | wc -l)
{ nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; free -g; nproc; df -h /tmp | tail -1; } > "$OUT/machine.txt"
B="torchrun --nproc_per_node $N tools/fsdp_bench.py"
timeout ${SMOKE_S:-90} $B --model tiny --batch 1 --seq 256 --warmup 1 --steps 2 \
  --optimizers none-bf16,bf16w-4bit-lean-offload > "$OUT/smoke.txt" 2>&1; echo "smoke rc $?" >> "$OUT/rc.txt"
for opt in ${CONFIGS:-none-bf16 bf16w-4bit-lean-offload bf16w-4bit-lean+budget12GiB}; do
  timeout ${ROW_S:-170} $B --model ${MODEL:-70b} --batch ${BATCH:-1} --seq ${SEQ:-4096} --warmup 2 --steps 8 \
    --optimizers "$opt" --json "$OUT/rows.jsonl" > "$OUT/${MODEL:-70b}_${opt}.txt" 2>&1
  echo "$opt rc $?" >> "$OUT/rc.txt"
done
cat "$OUT/rc.txt"; grep -h "^|" "$OUT"/*.txt | head -20
