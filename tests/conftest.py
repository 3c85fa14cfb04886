import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))

# Without a GPU the Triton kernels run in Triton's interpreter (set before triton is imported).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The CPU fast path runs eagerly in the suite (bit-identical to the reference, no compile time);
# tests/test_cpu_step.py turns compilation on where it tests the compiled path.
os.environ.setdefault("OPTSTATE_CPU_COMPILE", "0")

# The suite runs many tiny tensor ops: one intra-op thread is much faster for them than torch's
# default, and keeps timings sane on the 2-core CI machine.
torch.set_num_threads(1)
