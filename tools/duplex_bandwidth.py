"""Pinned host<->device bandwidth one way and both ways at once (two copy streams), 1 GiB copies."""
import torch

from optstate_core.apps.measure import copy_bandwidths

rates = copy_bandwidths(torch.device("cuda"), 2**30)
print(f"H2D {rates['h2d'] / 1e9:.1f} GB/s, D2H {rates['d2h'] / 1e9:.1f} GB/s, "
      f"both at once {2 * rates['duplex'] / 1e9:.1f} GB/s total ({rates['duplex'] / 1e9:.1f} GB/s each way)")
