"""Where the host time of ``step()`` goes (cProfile), for presets on Llama-shaped parameters on a GPU.

    python tools/host_profile.py --presets 8bit,4bit,fp32 [--scale 1.0] [--steps 30] [--top 25] [--backward]

With ``--backward`` every step's gradients come from an autograd backward (hooks run, as in
training; as ``optstate bench --backward``). The device is held busy by a sleep kernel while the
profiled steps are queued, as in a training loop whose host runs ahead, so launches never wait
for a full queue. To time another build: ``cd <its tree> && PYTHONPATH=. python tools/host_profile.py``
(and likewise for ``python -m optstate_core bench``, which puts the working directory on
``sys.path`` ahead of ``PYTHONPATH``).
"""
import argparse
import cProfile
import io
import pstats
import time

import torch

import optstate_core as oc
from optstate_core.apps.bench import llama_shapes


def build(preset, shapes):
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(s, device="cuda") * 0.02) for s in shapes]
    for p in ps:
        p.grad = torch.randn_like(p) * 1e-3
    inner = torch.optim.AdamW(ps, fused=True)
    return ps, inner if preset == "adamw" else oc.wrap(inner, preset)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--presets", default="adamw,fp32,8bit,4bit")
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--backward", action="store_true")
    args = parser.parse_args()
    shapes = llama_shapes(args.scale)
    for preset in args.presets.split(","):
        ps, opt = build(preset, shapes)
        fixed = [p.grad for p in ps]

        def new_grads():
            if args.backward:
                for p in ps:
                    p.grad = None
                torch.autograd.backward(ps, fixed)

        for _ in range(5):
            new_grads()
            opt.step()
        torch.cuda.synchronize()
        host = []
        for _ in range(args.steps):
            new_grads()
            torch.cuda.synchronize()
            torch.cuda._sleep(20_000_000)
            t = time.perf_counter()
            opt.step()
            host.append((time.perf_counter() - t) * 1e3)
            torch.cuda.synchronize()
        prof = cProfile.Profile()
        for _ in range(args.steps):
            new_grads()
            torch.cuda.synchronize()
            torch.cuda._sleep(20_000_000)
            prof.enable()
            opt.step()
            prof.disable()
            torch.cuda.synchronize()
        host.sort()
        print(f"\n=== {preset}: {len(ps)} tensors, host ms per step median {host[len(host) // 2]:.3f} "
              f"min {host[0]:.3f} (unprofiled)")
        out = io.StringIO()
        stats = pstats.Stats(prof, stream=out)
        stats.sort_stats("tottime").print_stats(args.top)
        stats.sort_stats("cumulative").print_stats(args.top)
        print(out.getvalue())
        del opt, ps
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
