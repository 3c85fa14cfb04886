"""What a fused step costs under the Triton interpreter per launch shape (why the test suite runs
32 tiles per program, unlooped): python tools/interpreter_cost.py [--shapes default,16x1,32x1,64x1]."""
import argparse
import os
import time

os.environ.setdefault("TRITON_INTERPRET", "1")
import torch  # noqa: E402

import optstate_core as oc  # noqa: E402
from optstate_core.step import fused_launch  # noqa: E402

SHAPES = [(256, 512), (512, 256), (256, 256), (512,), (256,)]


def step_ms(preset: str, steps: int = 3) -> float:
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]
    opt = oc.wrap(torch.optim.AdamW(ps, lr=1e-3), oc.make_policy(preset, min_int8_elements=0), fused=True)
    for p in ps:
        p.grad = torch.randn_like(p)
    opt.step()  # first step: allocation and the reference path
    t = time.perf_counter()
    for _ in range(steps):
        opt.step()
    return (time.perf_counter() - t) / steps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shapes", default="default,16x1,32x1,64x1", help="TILESxLOOPS per program, or default")
    args = parser.parse_args()
    torch.set_num_threads(1)
    gpu = dict(fused_launch.LAUNCH_SHAPES)
    print("| launch shape | 8bit ms/step | 4bit ms/step |\n|---|---:|---:|")
    for label in args.shapes.split(","):
        fused_launch.LAUNCH_SHAPES.update(gpu)
        if label != "default":
            tiles, loops = map(int, label.split("x"))
            for kind, (_, warps, _, regs) in gpu.items():
                fused_launch.LAUNCH_SHAPES[kind] = (tiles, warps, loops, regs)
        print(f"| {label} | {step_ms('8bit'):.0f} | {step_ms('4bit'):.0f} |", flush=True)


if __name__ == "__main__":
    main()
