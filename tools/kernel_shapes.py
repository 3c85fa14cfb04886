"""Time the fused step's launch shapes (tiles per program x warps) per preset on one GPU:
python tools/kernel_shapes.py [--layers 6] [--presets 8bit,4bit,bf16] [--shapes 4x4,2x2,...].

Llama-1B-shaped tensors (4 x 2048x2048 + 3 x 5632x2048 per layer), random gradients; prints
the median step time (CUDA events) per (preset, shape) and torch's fused AdamW for scale."""
import argparse
import statistics
import time

import torch

import optstate_core as oc
from optstate_core import fused_launch as fused


def params(layers: int):
    shapes = [(2048, 2048)] * 4 * layers + [(5632, 2048)] * 3 * layers
    ps = [torch.nn.Parameter(torch.randn(s, device="cuda") * 0.02) for s in shapes]
    for p in ps:
        p.grad = torch.randn_like(p) * 1e-3
    return ps


def timed(opt, steps: int, warmup: int):
    """Median (CUDA-event ms, wall-clock ms until the device is idle) of a step."""
    times, walls = [], []
    for i in range(warmup + steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        start.record()
        opt.step()
        end.record()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) * 1e3
        if i >= warmup:
            times.append(start.elapsed_time(end))
            walls.append(wall)
    return statistics.median(times), statistics.median(walls)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--presets", default="8bit,4bit,bf16")
    ap.add_argument("--shapes", default="4x4,2x2,2x4,4x8,8x8,1x1,1x2,8x4")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--iters", type=int, default=1, help="tiles per program, looped")
    args = ap.parse_args()
    ps = params(args.layers)
    n = sum(p.numel() for p in ps)
    ref, ref_wall = timed(torch.optim.AdamW(ps, fused=True), args.steps, 3)
    print(f"{n / 1e6:.0f}M parameters, {args.iters} tile loop(s) per program; torch AdamW fused: {ref:.3f} ms "
          f"(wall {ref_wall:.3f} ms)")
    print("| preset | tiles x warps | step ms | x fused | wall ms | x fused (wall) |\n|---|---|---:|---:|---:|---:|")
    for spec in args.presets.split(","):
        preset, _, flag = spec.partition(":")  # "8bit:nocheck" = skip_nonfinite=False
        for shape in args.shapes.split(","):
            nblk, warps = (int(x) for x in shape.split("x"))
            fused.LAUNCH_SHAPES.update({kind: (nblk, warps, args.iters, 0) for kind in fused.LAUNCH_SHAPES})
            qs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
            for q, p in zip(qs, ps):
                q.grad = p.grad
            opt = oc.wrap(torch.optim.AdamW(qs, fused=True), preset, skip_nonfinite=flag != "nocheck")
            ms, wall = timed(opt, args.steps, 3)
            print(f"| {spec} | {shape} | {ms:.3f} | {ms / ref:.2f} | {wall:.3f} | {wall / ref_wall:.2f} |", flush=True)
            opt.close()
            del opt, qs
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
