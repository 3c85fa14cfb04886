"""Where the fp32 passthrough's NaN/inf check costs least: a training iteration on the GPU.

    python tools/backward_check_e2e.py [--rounds 4] [--steps 8] [--hidden 2048] [--layers 16]

Trains the e2e bench's Llama-shaped model (bf16 autocast, batch 8x512) with four optimizers
over the same parameters, in interleaved rounds of back-to-back iterations (forward, backward,
step; wall clock until the device is idle, per iteration): torch's fused AdamW, the `fp32` preset
with its check in the step (the default), the same with ``check_in_backward=True``
(backward_check.py) and with ``skip_nonfinite=False``. Prints the median ms per
iteration, its min-max over rounds and the ratio to fused AdamW. Only one optimizer's backward
checks are active at a time (they all hook the same parameters).
"""
import argparse
import statistics
import time

import torch

import optstate_core as oc
from optstate_core.apps.e2e import build_model, train_step


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8, help="back-to-back iterations per round and optimizer")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=16)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    model = build_model(args.hidden, args.layers, 32000, int(args.hidden * 2.75), "cuda")
    params = list(model.parameters())
    tokens = torch.randint(0, 32000, (8, 512), device="cuda")

    def ours(**kw):
        return oc.wrap(torch.optim.AdamW(params, fused=True), "fp32", **kw)

    opts = {"torch AdamW fused": torch.optim.AdamW(params, fused=True),
            "optstate fp32, check_in_backward=True": ours(check_in_backward=True),
            "optstate fp32 (check in the step, the default)": ours(),
            "optstate fp32, skip_nonfinite=False": ours(skip_nonfinite=False)}
    hooked = opts["optstate fp32, check_in_backward=True"]

    def run(name):
        # only check_in_backward=True hooks the parameters, and only during its own iterations
        schedule = hooked._engine.schedule
        if name == "optstate fp32, check_in_backward=True":
            schedule.register_hooks(params)
            hooked._engine.backward_check.watch(params)
        else:
            schedule.remove_hooks()
        opt = opts[name]
        for _ in range(2):
            train_step(model, tokens, opt)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(args.steps):
            train_step(model, tokens, opt)
        torch.cuda.synchronize()
        return (time.perf_counter() - t) * 1e3 / args.steps

    times = {name: [] for name in opts}
    for _ in range(args.rounds):
        for name in opts:
            times[name].append(run(name))
    base = statistics.median(times["torch AdamW fused"])
    n = sum(p.numel() for p in params)
    print(f"training iteration, {n / 1e9:.3f}B params, batch 8x512, bf16 autocast, {torch.cuda.get_device_name()}, "
          f"torch {torch.__version__}; back to back, {args.rounds} rounds x {args.steps} iterations")
    print("| configuration | ms/iteration (median, min-max) | x fused AdamW | gradients checked in backward |")
    print("|---|---:|---:|---:|")
    for name, opt in opts.items():
        m = statistics.median(times[name])
        used = opt._engine.backward_check.used if hasattr(opt, "_engine") else ""
        print(f"| {name} | {m:.2f} ({min(times[name]):.2f}-{max(times[name]):.2f}) | {m / base:.4f} | {used} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
