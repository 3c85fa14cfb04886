#!/usr/bin/env bash
# The GPU suite: every test that can use a GPU, in one call, one summary line at the end.
#
#   bash tools/gpu_suite.sh [extra pytest arguments]
#
# Runs tests/kernels and tests/gpu whole on the real GPU (the kernels compiled, not interpreted),
# then every test marked `gpu` elsewhere; the 2-GPU tests run when 2 GPUs are visible and skip
# otherwise. Third-party wheels carried in .whl/ (see tools/README.md) are installed first.
# Logs and JUnit files go to $OUT/gpu_suite (or ./.out/gpu_suite). The last line reads
# `gpu-suite: N passed, N failed, N skipped, N errors in S s (GPU, torch X, triton Y)`;
# the exit code is 0 only if nothing failed. Whoever changes kernels, the engine, offload or
# release runs it on a GPU and quotes that line.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl > /dev/null 2>&1
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD:$PWD/integrations${PYTHONPATH:+:$PYTHONPATH}"
LOGS="${OUT:-$PWD/.out}/gpu_suite"; mkdir -p "$LOGS"
python3 -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" \
  || { echo "gpu-suite: no CUDA device visible; nothing run"; exit 1; }
START=$SECONDS
P=(python3 -m pytest -q -p no:cacheprovider --timeout 300 -o addopts="" -rfE)
# 1. kernels and GPU tests, in worker processes sharing the GPU (each test owns its tensors)
timeout -k 10 330 "${P[@]}" -n 4 --dist loadfile --junitxml "$LOGS/kernels_gpu.xml" tests/kernels tests/gpu "$@" \
  > "$LOGS/kernels_gpu.log" 2>&1
# 2. tests marked gpu in the rest of the suite
timeout -k 10 200 "${P[@]}" -m gpu --junitxml "$LOGS/marked.xml" tests --ignore tests/kernels --ignore tests/gpu "$@" \
  > "$LOGS/marked.log" 2>&1
tail -n 25 "$LOGS/kernels_gpu.log" "$LOGS/marked.log"
python3 - "$LOGS" $((SECONDS - START)) <<'EOF'
import pathlib, sys, xml.etree.ElementTree as ET
import torch, triton
logs, seconds = pathlib.Path(sys.argv[1]), sys.argv[2]
count = dict(passed=0, failed=0, skipped=0, errors=0)
for name in ("kernels_gpu.xml", "marked.xml"):
    path = logs / name
    if not path.exists():  # a run killed by its timeout leaves no report: count it as an error
        count["errors"] += 1
        continue
    for suite in ET.parse(path).getroot().iter("testsuite"):
        tests, failures, errors, skipped = (int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped"))
        count["failed"] += failures
        count["errors"] += errors
        count["skipped"] += skipped
        count["passed"] += tests - failures - errors - skipped
gpus = torch.cuda.device_count()
print(f"gpu-suite: {count['passed']} passed, {count['failed']} failed, {count['skipped']} skipped, "
      f"{count['errors']} errors in {seconds} s ({gpus} x {torch.cuda.get_device_name(0)}, "
      f"torch {torch.__version__}, triton {triton.__version__})")
sys.exit(1 if count["failed"] or count["errors"] else 0)
EOF
