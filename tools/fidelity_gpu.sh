#!/usr/bin/env bash
# GPU call (one GPU): fidelity of gradient release, the host-tier correction and the offload presets.
# 1. fine-tuning (bench --convergence --finetune: the demo's LM pretrained 300 steps by AdamW, then
#    200 steps on another text, 3 seeds), every row clipping at 1.0;
# 2. from scratch, a 19.5M byte-level LM (d_model 448, 8 layers, 7 heads), 800 steps at lr 1e-3,
#    3 seeds: release's clip rules (the exact global norm, one step late, per tensor) and no clipping.
# Results under $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:$PWD/integrations"
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
C="python3 -m optstate_core bench --convergence --device cuda --seeds 3 --no-progress"
[ -n "${SKIP_FINETUNE:-}" ] || timeout 160 $C --finetune --clip 1.0 --presets 8bit,8bit+release,bf16w-4bit-lean,bf16w-4bit-lean+release,\
bf16w-4bit-lean-hostcorr+release,bf16w-4bit-lean-offload+release 2>&1 | tee "$OUT/finetune.txt" | grep -E "^\||spread"
# the five from-scratch invocations run side by side (a 19.5M model leaves the GPU mostly idle; each
# process is bound by its own host thread)
S="$C --steps 800 --lr 1e-3 --d-model 448 --n-layers 8 --n-heads 7 --eval-every 200"
timeout ${SCRATCH_S:-540} $S --clip 1.0 --presets bf16w-4bit-lean,bf16w-4bit-lean+release > "$OUT/scratch_exact.txt" 2>&1 &
timeout ${SCRATCH_S:-540} $S --clip 1.0 --presets fp32+release > "$OUT/scratch_exact_fp32.txt" 2>&1 &
timeout ${SCRATCH_S:-540} $S --clip 1.0 --release-bucket-bytes 0 --presets bf16w-4bit-lean+release,fp32+release \
  > "$OUT/scratch_late.txt" 2>&1 &
timeout ${SCRATCH_S:-540} $S --clip 1.0 --clip-mode per_tensor --presets bf16w-4bit-lean+release \
  > "$OUT/scratch_per_tensor.txt" 2>&1 &
timeout ${SCRATCH_S:-540} $S --clip 0 --presets bf16w-4bit-lean,bf16w-4bit-lean+release > "$OUT/scratch_noclip.txt" 2>&1 &
wait
grep -hE "^\||spread|^byte" "$OUT"/scratch_*.txt
