"""CPU benchmark: the optimizer step alone and the demo's training step, against torch AdamW.

    python tools/cpu_step_bench.py [--rounds 5] [--presets 8bit,4bit] [--threads 2] [--reference]

Part 1 times ``step()`` on fp32 parameters in Llama-like shapes (``--scale``/``--layers`` of
``llama_shapes``) with random gradients; part 2 times the demo's whole training step (forward,
backward, clipping, ``step()``) on its TinyLM and corpus. Every configuration lives in one
process and is timed in interleaved rounds (A, B, C, A, B, C, ...), so load from other
processes falls on all of them alike; each round gives a median ms per step and a ratio to
torch AdamW measured in that round (the step alone: ``AdamW(fused=True)``; the demo step: the
demo's own AdamW, torch's default). The table prints the median over rounds and the
min-max spread. "first s" is the wall time of the untimed warm-up steps (compilation included).
``--reference`` adds the 8bit tiled reference path (``OPTSTATE_CPU_FAST=0``), i.e. the path
without the CPU fast path (slow).
"""
import argparse
import os
import statistics
import time

import torch

import optstate_core as oc
from optstate_core.apps.bench import llama_shapes
from optstate_core.apps.corpus import load_corpus, train_offsets, windows
from optstate_core.apps.demo import build_optimizer
from optstate_core.apps.demo_config import DemoConfig
from optstate_core.apps.tinylm import TinyLM


class Config:
    """One optimizer configuration; ``fast`` sets OPTSTATE_CPU_FAST while it runs."""

    def __init__(self, name, preset, fast=True):
        self.name, self.preset, self.fast = name, preset, fast

    def __enter__(self):
        self._saved = os.environ.get("OPTSTATE_CPU_FAST")
        os.environ["OPTSTATE_CPU_FAST"] = "1" if self.fast else "0"

    def __exit__(self, *exc):
        if self._saved is None:
            os.environ.pop("OPTSTATE_CPU_FAST", None)
        else:
            os.environ["OPTSTATE_CPU_FAST"] = self._saved


def configs(presets, reference):
    out = [Config("torch AdamW (fused)", "adamw_fused"), Config("torch AdamW (default)", "adamw"),
           Config("torch AdamW (foreach)", "adamw_foreach")]
    out += [Config(f"optstate {p}", p) for p in presets]
    if reference:
        out.append(Config("optstate 8bit, tiled reference", "8bit", fast=False))
    return out


def build_step_alone(cfg, shapes, seed=0):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen) * 0.02) for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen) * 1e-3
    if cfg.preset == "adamw_foreach":
        return torch.optim.AdamW(params, foreach=True)
    if cfg.preset == "adamw_fused":
        return torch.optim.AdamW(params, fused=True)
    if cfg.preset == "adamw":
        return torch.optim.AdamW(params)
    return oc.wrap(torch.optim.AdamW(params), cfg.preset)


class DemoRun:
    """One demo training run (TinyLM, the demo's optimizer and data), stepped on demand."""

    def __init__(self, cfg, demo_cfg, corpus):
        torch.manual_seed(demo_cfg.seed)
        self.model = TinyLM.from_config(demo_cfg)
        preset = None if cfg.preset.startswith("adamw") else cfg.preset
        self.opt = build_optimizer(self.model, demo_cfg, preset)
        for flag in ("foreach", "fused"):
            if cfg.preset == f"adamw_{flag}":
                for g in self.opt.param_groups:
                    g[flag] = True
        self.offsets = train_offsets(corpus, demo_cfg)
        self.corpus, self.demo_cfg, self.i = corpus, demo_cfg, 0

    def step(self):
        batch = windows(self.corpus.train, self.offsets[self.i % len(self.offsets)], self.demo_cfg.seq_len)
        self.i += 1
        loss = self.model.loss(batch)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        return loss.item()


def timed(fn, n):
    """Median wall ms and median process CPU ms per call over ``n`` calls."""
    wall, cpu = [], []
    for _ in range(n):
        t, c = time.perf_counter(), time.process_time()
        fn()
        wall.append((time.perf_counter() - t) * 1e3)
        cpu.append((time.process_time() - c) * 1e3)
    return statistics.median(wall), statistics.median(cpu)


def measure(cfgs, objects, step_fn, rounds, steps, warmup):
    first = {}
    for cfg in cfgs:
        with cfg:
            t = time.perf_counter()
            for _ in range(warmup):
                step_fn(objects[cfg.name])
            first[cfg.name] = time.perf_counter() - t
    per_round = {cfg.name: [] for cfg in cfgs}
    for _ in range(rounds):
        for cfg in cfgs:
            with cfg:
                per_round[cfg.name].append(timed(lambda: step_fn(objects[cfg.name]), steps))
    return first, per_round


def print_table(title, cfgs, first, per_round, ref_name):
    print(f"\n{title}")
    head = "| configuration | first s | wall ms/step (median, min-max) | x AdamW wall (median, min-max) " \
           "| cpu ms/step | x AdamW cpu |"
    print(head)
    print("|" + "|".join("-" * (len(c)) for c in head.split("|")[1:-1]) + "|")
    ref = per_round[ref_name]
    for cfg in cfgs:
        rows = per_round[cfg.name]
        walls = [w for w, _ in rows]
        ratios = [w / r[0] for (w, _), r in zip(rows, ref)]
        cpu_ratios = [c / r[1] for (_, c), r in zip(rows, ref)]
        print(f"| {cfg.name} | {first[cfg.name]:.1f} | {statistics.median(walls):.1f} ({min(walls):.1f}-{max(walls):.1f})"
              f" | {statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"
              f" | {statistics.median(c for _, c in rows):.1f} | {statistics.median(cpu_ratios):.2f} |")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", default="8bit,4bit")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per configuration per round")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation happens here)")
    parser.add_argument("--scale", type=float, default=0.125)
    parser.add_argument("--layers", type=int, default=9, help="9 layers at scale 0.125: 9.8M parameters")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reference", action="store_true", help="add the 8bit tiled reference path (slow)")
    parser.add_argument("--skip", choices=("step", "demo"), default=None, help="leave out one part")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    cfgs = configs([p for p in args.presets.split(",") if p], args.reference)
    print(f"torch {torch.__version__}, {args.threads} threads, {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.1f}, {time.strftime('%Y-%m-%d %H:%M')}")
    if args.skip != "step":
        shapes = llama_shapes(args.scale, args.layers)
        n = sum(torch.Size(s).numel() for s in shapes)
        objects = {cfg.name: build_step_alone(cfg, shapes) for cfg in cfgs}
        first, per_round = measure(cfgs, objects, lambda o: o.step(), args.rounds, args.steps, args.warmup)
        print_table(f"optimizer step alone, {n / 1e6:.1f}M fp32 params ({len(shapes)} tensors), "
                    f"{args.rounds} rounds x {args.steps} steps; x AdamW = torch AdamW (fused=True)", cfgs, first, per_round,
                    cfgs[0].name)
        del objects
    if args.skip != "demo":
        demo_cfg = DemoConfig()
        corpus = load_corpus(demo_cfg.data, demo_cfg.max_bytes)
        objects = {cfg.name: DemoRun(cfg, demo_cfg, corpus) for cfg in cfgs}
        first, per_round = measure(cfgs, objects, lambda r: r.step(), args.rounds, args.steps, args.warmup)
        print_table(f"demo training step (forward + backward + clip + step), TinyLM "
                    f"{sum(p.numel() for p in objects[cfgs[0].name].model.parameters()) / 1e6:.2f}M params, "
                    f"batch {demo_cfg.batch_size}x{demo_cfg.seq_len}, {args.rounds} rounds x {args.steps} steps; "
                    "x AdamW = the demo's AdamW (torch default)",
                    cfgs, first, per_round, cfgs[1].name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
