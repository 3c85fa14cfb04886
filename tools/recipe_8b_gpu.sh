#!/usr/bin/env bash
# GPU call (one 80 GB GPU, issue 39): the GPU tests of offloaded state and of the example; then
# examples/finetune_8b_24gb.py at Llama-3-8B shapes through the HF Trainer, interleaved: under a
# 24 GB cap (bf16w-4bit-lean-offload) and on the whole card (bf16w-4bit-lean, resident), micro-batch
# 1 and 2; -hostcorr under a 32 GB cap against resident at 8B and 0.95B. Every step time-boxed under
# a deadline, orphans killed between steps; results under $OUT: rows.jsonl, log.txt, rc.txt.
# (STEPS_LIST picks other steps: "lightning accelerate torchao resume pin cmp1 cmp1_ahead8 cmp4 gputests hostcorr5_ahead8 hostcorr5 hostcorr5_095b
# deepspeed_095b deepspeed duplex profile1 ahead_sweep cmp32 cmp4_2 cmp1_ahead4 trainer" are the
# others; the example's default
# --preset plan runs what optstate plan picks for the cap and micro-batch; cmp*/hostcorr5* alternate the recipe with resident state on the
# whole card in one process; deepspeed* install DeepSpeed from .dsw/ first, whose CPU Adam builds just in time.)
set -uo pipefail
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=16
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH="/tmp/site:$PWD:$PWD/integrations"
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; LOG="$OUT/log.txt"
START=$SECONDS; source tools/gpu_call_lib.sh
install_deepspeed() {  # once: DeepSpeed's source archive and the wheels it lacks here, from .dsw/
  [ -d /tmp/site/deepspeed ] && return
  DS_BUILD_OPS=0 timeout 120 python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir \
    --target /tmp/site .dsw/*.whl .dsw/deepspeed-*.tar.gz >> "$LOG" 2>&1; echo "deepspeed install rc $?" >> "$LOG"
}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$OUT/rc.txt"
{ nvidia-smi topo -m; ls -d /sys/devices/system/node/node* ; free -g; nproc; } >> "$LOG" 2>&1
E="python3 examples/finetune_8b_24gb.py --json $OUT/rows.jsonl --steps ${STEPS:-6}"
P="python3 -m pytest -q -p no:cacheprovider"
for step in ${STEPS_LIST:-tests timing hostcorr}; do case $step in
tests)
  run test_resume_fused 90 $P tests/gpu/test_resume_fused.py -k "lean"
  run test_release_offload 90 $P tests/gpu/test_release_offload.py
  run test_example_gpu 80 $P tests/integrations/test_finetune_8b_example.py -m gpu ;;
timing)
  for mb in 1 2 1 2; do
    run "trainer_cap24_mb$mb" 75 $E --gpu-memory 24GB --micro-batch $mb
    run "trainer_whole_mb$mb" 70 $E --preset bf16w-4bit-lean --micro-batch $mb
  done ;;
hostcorr)
  run trainer_cap32_hostcorr_8b 60 $E --gpu-memory 32GB --preset bf16w-4bit-lean-hostcorr
  for i in 1 2; do
    run trainer_whole_095b 45 $E --shape 0.95b --preset bf16w-4bit-lean
    run trainer_cap32_hostcorr_095b 45 $E --shape 0.95b --gpu-memory 32GB --preset bf16w-4bit-lean-hostcorr
  done ;;
trainer) run trainer_cap24_mb2 90 $E --gpu-memory 24GB --micro-batch 2 ;;
lightning) run lightning_cap24_mb2 90 $E --gpu-memory 24GB --micro-batch 2 --framework lightning ;;
accelerate) run accelerate_cap24_mb2 90 $E --gpu-memory 24GB --micro-batch 2 --framework accelerate ;;
torchao) run torchao_cap24_mb2 110 $E --gpu-memory 24GB --micro-batch 2 --optimizer torchao-offload --steps 4 ;;
pin) run pin_bench 100 python3 tools/pin_bench.py --gib 16 ;;
cmp1) run cmp_cap24_mb1 200 $E --gpu-memory 24GB --micro-batch 1 --against-resident --repeats 3 ;;
cmp1_ahead8) run cmp_cap24_mb1_ahead8 200 env OPTSTATE_STAGE_AHEAD=8 $E --gpu-memory 24GB --micro-batch 1 \
  --against-resident --repeats 3 ;;
cmp4)
  run cmp_cap24_mb4 230 $E --gpu-memory 24GB --micro-batch 4 --against-resident --repeats 3
  grep -q "cmp_cap24_mb4 rc 0" "$OUT/rc.txt" || run cmp_cap24_mb2 200 $E --gpu-memory 24GB --micro-batch 2 \
    --against-resident --repeats 3 ;;
cmp1_ahead4) run cmp_cap24_mb1_ahead4 200 env OPTSTATE_STAGE_AHEAD=4 $E --gpu-memory 24GB --micro-batch 1 \
  --against-resident --repeats 3 ;;
cmp32) run cmp_cap32_mb1 200 $E --gpu-memory 32GB --micro-batch 1 --against-resident --repeats 3 ;;
cmp4_2) run cmp_cap24_mb4_2 170 $E --gpu-memory 24GB --micro-batch 4 --against-resident --repeats 2 ;;
gputests) run gpu_tests 330 $P --timeout 240 tests/gpu tests/integrations/test_finetune_8b_example.py -m gpu ;;
hostcorr5_ahead8) run cmp_hostcorr_cap32_8b_ahead8 240 env OPTSTATE_STAGE_AHEAD=8 $E --gpu-memory 32GB \
  --preset bf16w-4bit-lean-hostcorr --against-resident --repeats 5 ;;
hostcorr5) run cmp_hostcorr_cap32_8b 260 $E --gpu-memory 32GB --preset bf16w-4bit-lean-hostcorr --against-resident \
  --repeats 5 ;;
hostcorr5_095b) run cmp_hostcorr_cap32_095b 120 $E --shape 0.95b --gpu-memory 32GB --preset bf16w-4bit-lean-hostcorr \
  --against-resident --repeats 5 ;;
deepspeed_095b)
  install_deepspeed
  run deepspeed_cap24_095b_mb2 200 torchrun --nproc_per_node 1 examples/finetune_8b_24gb.py --json $OUT/rows.jsonl \
    --steps 5 --shape 0.95b --gpu-memory 24GB --micro-batch 2 --optimizer deepspeed-offload
  run optstate_cap24_095b_mb2 60 $E --shape 0.95b --gpu-memory 24GB --micro-batch 2 --steps 5 ;;
deepspeed)
  install_deepspeed
  run deepspeed_cap24_8b_mb2 240 torchrun --nproc_per_node 1 examples/finetune_8b_24gb.py --json $OUT/rows.jsonl \
    --steps 4 --gpu-memory 24GB --micro-batch 2 --optimizer deepspeed-offload ;;
duplex) run pin_duplex 60 python3 tools/pin_bench.py --gib 2 --modes torch-register-8 ;;
profile1)  # a trace of steps 3-4 at micro-batch 1, the recipe under the cap and resident state, summarised
  for side in "recipe --gpu-memory 24GB" "resident --preset bf16w-4bit-lean"; do set -- $side; name=$1; shift
    run "profile_mb1_$name" 100 $E --micro-batch 1 "$@" --profile-trace /tmp/trace_$name.json
    timeout 60 python3 tools/trace_timeline.py /tmp/trace_$name.json --gap-ms 0.5 > "$OUT/trace_$name.txt" 2>&1
  done ;;
ahead_sweep)  # micro-batch 1 under the cap with more release batches staged ahead, and resident state under a budget
  for n in 16 32; do run "cap24_mb1_ahead$n" 75 env OPTSTATE_STAGE_AHEAD=$n $E --gpu-memory 24GB --micro-batch 1; done
  run cap24_mb1_budget3 75 $E --gpu-memory 24GB --micro-batch 1 --preset bf16w-4bit-lean --gpu-budget 3GiB ;;
resume) run resume_095b_offload 70 torchrun --nproc_per_node 1 tools/fsdp_dcp_resume.py --model 0.95b \
  --checkpoint /tmp/dcp --optimizers bf16w-4bit-lean-offload+release ;;
esac; done
rm -f "$OUT/step.txt"; cat "$OUT/rc.txt"; grep -h "^| trainer\|^| lightning\|^| accelerate\|^recipe\|^resident\|passed\|failed" "$LOG"
