"""Pinned host<->device bandwidth one way and both ways at once (two copy streams)."""
import time

import torch

n = 2**30
host_a = torch.empty(n, dtype=torch.uint8, pin_memory=True)
host_b = torch.empty(n, dtype=torch.uint8, pin_memory=True)
dev_a = torch.empty(n, dtype=torch.uint8, device="cuda")
dev_b = torch.empty(n, dtype=torch.uint8, device="cuda")
up, down = torch.cuda.Stream(), torch.cuda.Stream()


def timed(fn, reps=5):
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps


def h2d():
    with torch.cuda.stream(up):
        dev_a.copy_(host_a, non_blocking=True)


def d2h():
    with torch.cuda.stream(down):
        host_b.copy_(dev_b, non_blocking=True)


def both():
    h2d()
    d2h()


t_up, t_down, t_both = timed(h2d), timed(d2h), timed(both)
print(f"H2D {n / t_up / 1e9:.1f} GB/s, D2H {n / t_down / 1e9:.1f} GB/s, "
      f"both at once {2 * n / t_both / 1e9:.1f} GB/s total ({n / t_both / 1e9:.1f} GB/s each way)")
