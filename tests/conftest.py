import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))

# Without a GPU the Triton kernels run in Triton's interpreter (set before triton is imported).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The suite runs many tiny tensor ops: one intra-op thread is much faster for them than torch's
# default, and keeps timings sane on the 2-core CI machine.
torch.set_num_threads(1)
