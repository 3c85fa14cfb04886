import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))

# Without a GPU the Triton kernels run in Triton's interpreter (set before triton is imported).
# The interpreter's cost is per program and per loop iteration, not per element (a 4-bit step of
# 0.4M parameters: 26.5 s at the GPU's 1-tile x 16-loop shape, 1.1 s at 32 tiles x 1), so the suite
# launches 128 tiles of 256 elements per program, unlooped (16% less time than 32 tiles over the
# release, FSDP2-schedule and slab tests): the larger test tensors still span several programs with
# a partial last one. The GPU's own shapes (loops, NBLK 1-4) are run by
# tests/kernels/test_fused_step.py::test_tiles_per_program_do_not_change_results.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    if os.environ["TRITON_INTERPRET"] == "1":
        os.environ.setdefault("OPTSTATE_NBLK", "128")
        os.environ.setdefault("OPTSTATE_ITERS", "1")

# The CPU fast path runs eagerly in the suite (bit-identical to the reference, no compile time;
# the default "auto" would compile only after 10 s of eager time per class, which no test reaches);
# tests/test_cpu_step.py turns compilation on where it tests the compiled path.
os.environ.setdefault("OPTSTATE_CPU_COMPILE", "0")

# The suite runs many tiny tensor ops: one intra-op thread is much faster for them than torch's
# default, and keeps timings sane on the 2-core CI machine.
torch.set_num_threads(1)
