#!/usr/bin/env python3
"""How fast pinned host memory can be had: the offload presets pin all their state in the first step.

Each mode runs in a fresh process and pins ``--gib`` GiB in slabs of ``--slab-mib`` MiB, then copies
1 GiB from it to the GPU and back three times (page-locked memory copies at PCIe speed), then 0.5 GiB
each way at once on two streams (an offloaded step's uploads and write-backs overlap):

- ``torch``: ``torch.empty(..., pin_memory=True)`` (torch's caching host allocator: cudaHostAlloc);
- ``torch-register-8``: the same with ``PYTORCH_CUDA_ALLOC_CONF=pinned_use_cuda_host_register:True,
  pinned_num_register_threads:8`` (malloc, pages touched by 8 threads, cudaHostRegister);
- ``prefault-register``: ordinary host memory, every page touched by torch's intra-op threads
  (``zero_``), then ``cudaHostRegister`` on it.

    python tools/pin_bench.py --gib 16
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

MODES = ("torch", "torch-register-8", "prefault-register")
ENV = {"torch-register-8": "pinned_use_cuda_host_register:True,pinned_num_register_threads:8"}


def one_mode(mode: str, gib: float, slab_mib: int) -> dict:
    """Pin ``gib`` GiB in this process the ``mode`` way; seconds and GB/s of pinning and copying."""
    import torch
    torch.cuda.init()
    torch.empty(1, device="cuda")
    slab = slab_mib * 2**20
    n = max(1, int(gib * 2**30 // slab))
    slabs, registered = [], []
    t0 = time.perf_counter()
    for _ in range(n):
        if mode == "prefault-register":
            t = torch.empty(slab, dtype=torch.uint8).zero_()
            err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), slab, 0)
            if int(err) != 0:
                raise RuntimeError(f"cudaHostRegister failed: {err}")
            registered.append(t.data_ptr())
        else:
            t = torch.empty(slab, dtype=torch.uint8, pin_memory=True)
        slabs.append(t)
    pin_s = time.perf_counter() - t0
    gpu = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    times = {"h2d": [], "d2h": []}
    chunks = slabs[: max(1, 2**30 // slab)]
    for _ in range(3):  # the first copy and the best of three
        for name in ("h2d", "d2h"):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            off = 0
            for c in chunks:
                if name == "h2d":
                    gpu[off:off + c.numel()].copy_(c, non_blocking=True)
                else:
                    c.copy_(gpu[off:off + c.numel()], non_blocking=True)
                off += c.numel()
            torch.cuda.synchronize()
            times[name].append(off / (time.perf_counter() - t0) / 1e9)
    both = duplex(gpu, chunks, slabs[len(chunks):2 * len(chunks)] or chunks)
    for ptr in registered:
        torch.cuda.cudart().cudaHostUnregister(ptr)
    return {"mode": mode, "gib": n * slab / 2**30, "pin_s": pin_s, "pin_gbps": n * slab / pin_s / 1e9,
            "is_pinned": bool(slabs[0].is_pinned()), "h2d_gbps": times["h2d"], "d2h_gbps": times["d2h"],
            "duplex_gbps": both}


def duplex(gpu, sources, targets) -> list:
    """GB/s each way with uploads (``sources`` -> first half of ``gpu``) and downloads (second half
    -> ``targets``) running at once on two streams, three times (an offloaded step moves its state
    both ways at once)."""
    import torch
    half = gpu.numel() // 2
    pairs = [(gpu[:half], sources, True), (gpu[half:], targets, False)]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    out = []
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        moved = []
        for stream, (device_half, hosts, upload) in zip(streams, pairs):
            off = 0
            with torch.cuda.stream(stream):
                for c in hosts:
                    n = min(c.numel(), half - off)
                    if n <= 0:
                        break
                    dst, src = (device_half[off:off + n], c[:n]) if upload else (c[:n], device_half[off:off + n])
                    dst.copy_(src, non_blocking=True)
                    off += n
            moved.append(off)
        torch.cuda.synchronize()
        out.append(min(moved) / (time.perf_counter() - t0) / 1e9)
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gib", type=float, default=16.0)
    p.add_argument("--slab-mib", type=int, default=256)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:
        print(json.dumps(one_mode(args.one, args.gib, args.slab_mib)))
        return
    print("| mode | GiB | pin s | pin GB/s | is_pinned | H2D GB/s (first, best of 3) | D2H GB/s (first, best) | "
          "both at once, GB/s each way (best) |\n|---|---:|---:|---:|---|---:|---:|---:|")
    for mode in args.modes.split(","):
        env = dict(os.environ)
        if mode in ENV:
            env["PYTORCH_CUDA_ALLOC_CONF"] = ENV[mode]
        proc = subprocess.run([sys.executable, __file__, "--one", mode, "--gib", str(args.gib), "--slab-mib",
                               str(args.slab_mib)], env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            print(f"| {mode} | failed: {proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else proc.returncode} |")
            continue
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        print(f"| {r['mode']} | {r['gib']:.1f} | {r['pin_s']:.2f} | {r['pin_gbps']:.1f} | {r['is_pinned']} | "
              f"{r['h2d_gbps'][0]:.1f}, {max(r['h2d_gbps']):.1f} | {r['d2h_gbps'][0]:.1f}, {max(r['d2h_gbps']):.1f} | "
              f"{max(r['duplex_gbps']):.1f} |")


if __name__ == "__main__":
    main()
