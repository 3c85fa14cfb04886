"""Profile one optimizer configuration's step on a GPU: kernel times and host time per step.

    python tools/profile_step.py --preset 8bit [--scale 1.0] [--nocheck]
"""
import argparse
import time

import torch

import optstate_core as oc
from optstate_core.apps.bench import llama_shapes

parser = argparse.ArgumentParser()
parser.add_argument("--preset", default="8bit")
parser.add_argument("--scale", type=float, default=1.0)
parser.add_argument("--nocheck", action="store_true")
args = parser.parse_args()
torch.manual_seed(0)
ps = [torch.nn.Parameter(torch.randn(s, device="cuda") * 0.02) for s in llama_shapes(args.scale)]
for p in ps:
    p.grad = torch.randn_like(p) * 1e-3
if args.preset == "adamw":
    opt = torch.optim.AdamW(ps, fused=True)
else:
    opt = oc.wrap(torch.optim.AdamW(ps, fused=True), args.preset, skip_nonfinite=not args.nocheck)
for _ in range(3):
    opt.step()
torch.cuda.synchronize()
t = time.perf_counter()
for _ in range(10):
    opt.step()
host = (time.perf_counter() - t) / 10
torch.cuda.synchronize()
wall = (time.perf_counter() - t) / 10
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA, torch.profiler.ProfilerActivity.CPU]) as prof:
    for _ in range(3):
        opt.step()
    torch.cuda.synchronize()
print(f"{args.preset}{' nocheck' if args.nocheck else ''}: host {host * 1e3:.2f} ms/step (launch side), "
      f"wall {wall * 1e3:.2f} ms/step")
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=8, max_name_column_width=60))
