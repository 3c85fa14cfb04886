"""optstate: optimizer-state virtualization for PyTorch.

Commands:
  demo    train a small language model with AdamW and with optstate presets; compare loss,
          optimizer memory and step time (CPU or CUDA; writes metrics.csv and demo.png)
  bench   time the optimizer step per configuration; --convergence: held-out loss gap to AdamW
          over several seeds; --e2e: whole training steps; --capacity: the largest model each
          optimizer trains on one GPU; --peak-bytes: GPU bytes/param at a training step's peak
  plan    what fits? optimizer-state and training memory per preset for a model and a GPU
  compat  which torch optimizers wrap with which preset, and how close they stay (docs/compatibility.md)
  env     the OPTSTATE_* environment settings: each one's value now, its default (docs/environment.md)

Also runnable as `python -m optstate_core <command>`. `optstate <command> --help` lists
each command's options.
"""
from __future__ import annotations

import argparse
import logging
import re
import sys
import textwrap
from typing import Optional, Sequence


def _plain(doc: str) -> str:
    """A module docstring as --help text: reST roles and double backquotes removed."""
    return re.sub(r":\w+:`~?([^`]*)`", r"\1", doc or "").replace("``", "")


def _demo_parser(sub) -> None:
    from . import demo
    p = sub.add_parser("demo", help="train a small LM with AdamW and optstate presets, compare them",
                       description=_plain(demo.__doc__), formatter_class=argparse.RawDescriptionHelpFormatter)
    demo.add_arguments(p)
    p.set_defaults(handler=demo.run)


def _bench_parser(sub) -> None:
    from . import bench, convergence, demo
    p = sub.add_parser("bench", help="optimizer-step microbenchmark; --convergence: fidelity over seeds",
                       description=_plain(bench.__doc__), formatter_class=argparse.RawDescriptionHelpFormatter)
    bench.add_arguments(p)
    steps_default = p.get_default("steps")
    p.set_defaults(steps=None, handler=_bench, bench_steps_default=steps_default)
    g = p.add_argument_group("convergence (--convergence)", textwrap.fill(
        "The demo's training (see `optstate demo --help`) for seeds --seed, --seed + 1, ... with AdamW and each "
        "preset: each preset's final held-out loss gap to AdamW next to AdamW's own seed-to-seed spread. With "
        f"--convergence, --steps is the number of training steps per run (default: {demo.DemoConfig.steps}) and "
        "--device picks the training device.", width=88))
    g.add_argument("--convergence", action="store_true", help="run the convergence benchmark instead")
    g.add_argument("--seeds", type=int, default=3, help="seeds per preset, at least 2 (default: %(default)s)")
    g.add_argument("--out", default=None, help="also write convergence.csv (one row per run and seed) here")
    g.add_argument("--finetune", action="store_true",
                   help="fine-tune from a checkpoint instead of training from scratch: AdamW pretrains one model on "
                        "--data, every run starts from it and trains on --finetune-data")
    g.add_argument("--pretrain-steps", type=int, default=None,
                   help=f"with --finetune: AdamW steps of the checkpoint (default: {convergence.PRETRAIN_STEPS})")
    g.add_argument("--finetune-data", default=None,
                   help="with --finetune: a directory of .py files (or one text file) to fine-tune on "
                        "(default: torch's own Python sources)")
    g.add_argument("--finetune-lr", type=float, default=None,
                   help="with --finetune: the fine-tuning runs' peak learning rate (default: --lr / 10)")
    demo.add_training_arguments(g, skip=("steps", "device"))


def _bench(args) -> int:
    from . import bench, convergence
    if args.convergence:
        return convergence.run(args)
    if args.steps is None and not (args.capacity or args.peak_bytes):
        args.steps = args.bench_steps_default
    return bench.run(args)


def _plan_parser(sub) -> None:
    from . import plan, plan_cli
    p = sub.add_parser("plan", help="what fits? optimizer-state and training memory per preset (no GPU needed)",
                       description=_plain(plan.__doc__), formatter_class=argparse.RawDescriptionHelpFormatter)
    plan_cli.add_arguments(p)
    p.set_defaults(handler=plan_cli.run)


def _compat_parser(sub) -> None:
    from . import compat
    p = sub.add_parser("compat", help="every torch optimizer x the presets: works, bits/param, loss gap",
                       description=_plain(compat.__doc__), formatter_class=argparse.RawDescriptionHelpFormatter)
    compat.add_arguments(p)
    p.set_defaults(handler=compat.run)


def _env_parser(sub) -> None:
    from . import env_table
    p = sub.add_parser("env", help="the OPTSTATE_* environment settings: value now, default, kind",
                       description=_plain(env_table.__doc__), formatter_class=argparse.RawDescriptionHelpFormatter)
    env_table.add_arguments(p)
    p.set_defaults(handler=env_table.run)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="optstate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging, and tracebacks for errors")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{demo,bench,plan,compat,env}")
    _demo_parser(sub)
    _bench_parser(sub)
    _plan_parser(sub)
    _compat_parser(sub)
    _env_parser(sub)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Console entry point (``optstate``); returns the exit status. Bad arguments exit with status 2."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(message)s")
    try:
        return args.handler(args)
    except ValueError as e:  # a bad option value: a usage error, not a traceback (unless --verbose)
        if args.verbose:
            raise
        parser.exit(2, f"optstate {args.command}: error: {e}\n")


if __name__ == "__main__":
    sys.exit(main())
