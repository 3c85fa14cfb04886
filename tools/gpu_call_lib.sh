# Sourced by the GPU call scripts (tools/recipe_8b_gpu.sh, tools/fsdp_frameworks_8b_gpu.sh): ``run NAME
# LIMIT CMD...`` runs one step time-boxed under the call's DEADLINE (seconds since START), appends the
# tail of its output to $LOG (TAIL_OK lines on success, 40 on failure) and its exit code to
# $OUT/rc.txt, then kills every process a step may leave behind.
START=${START:-$SECONDS}; DEADLINE=${DEADLINE:-560}; TAIL_OK=${TAIL_OK:-4}
run() {
  local name=$1 limit=$2; shift 2
  local left=$((DEADLINE - (SECONDS - START)))
  if [ "$left" -lt 25 ]; then echo "$name skipped (deadline)" >> "$OUT/rc.txt"; return; fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "=== $name ($(nvidia-smi --query-gpu=memory.used --format=csv,noheader | paste -sd' ') in use before)" >> "$LOG"
  timeout -k 5 "$limit" "$@" > "$OUT/step.txt" 2>&1; local rc=$?
  if [ $rc -eq 0 ]; then grep -v "^{'\|Warning" "$OUT/step.txt" | tail -"$TAIL_OK" >> "$LOG"; else tail -40 "$OUT/step.txt" >> "$LOG"; fi
  echo "$name rc $rc $((SECONDS - START))s" >> "$OUT/rc.txt"
  for p in finetune_8b_24gb.py "pytest -q" fsdp_dcp_resume fsdp_bench pin_bench torchrun; do pkill -9 -f "$p"; done
  sleep 2
}
