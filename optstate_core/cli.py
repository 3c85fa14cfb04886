"""Command line: ``optstate demo`` (also ``python -m optstate_core demo``)."""
from __future__ import annotations

import argparse
import logging
import sys

import torch

from . import wrap
from .units import format_bytes


def demo(args) -> int:
    """Train a small MLP with AdamW and with an optstate preset; print state memory saved."""
    torch.manual_seed(0)
    results = {}
    for name in ["adamw", args.preset]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        if name != "adamw":
            opt = wrap(opt, name)
        g = torch.Generator().manual_seed(1)
        for _ in range(args.steps):
            x = torch.randn(64, 256, generator=g)
            loss = ((model(x) - x.flip(1)) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        state = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
                    if isinstance(v, torch.Tensor) and v.dim() > 0) if name == "adamw" else \
            opt.memory_report()["state_bytes"]
        results[name] = (loss.item(), state)
    for name, (loss, state) in results.items():
        print(f"{name:>8}: final loss {loss:.4f}  optimizer state {format_bytes(state)}")
    saved = results["adamw"][1] - results[args.preset][1]
    print(f"memory saved by '{args.preset}': {format_bytes(saved)} ({saved / results['adamw'][1]:.0%})")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="optstate", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="train a small model with AdamW and an optstate preset")
    p.add_argument("--preset", default="8bit", help="optstate preset (default: 8bit)")
    p.add_argument("--steps", type=int, default=200, help="training steps (default: 200)")
    p.set_defaults(fn=demo)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
