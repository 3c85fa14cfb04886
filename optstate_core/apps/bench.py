"""Optimizer-step microbenchmark: ``optstate bench`` (also ``python -m optstate_core bench``).

Builds fp32 parameters in Llama-1B shapes (``--scale`` shrinks every dimension), gives them
random gradients, and times ``step()`` for each configuration in one process: state
bits/param (bytes the optimizer holds between steps x 8 / parameters), median step ms, the
ratio to ``torch.optim.AdamW(fused=True)`` measured in the same run, and the peak extra memory
during ``step()``. The master-weight presets (``bf16w-*``) step the same values rounded to bf16
(bf16 parameters and gradients, fp32 masters as parameter + correction), against the same fp32
AdamW row; their state bits include the correction. Configurations with host-tier state also print
their PCIe floor (host-tier bytes up and down over the measured pinned bandwidth).

Timings on CUDA (medians over ``--steps``): "step ms", CUDA events around ``step()`` right after
a device synchronisation (the device idles while the host prepares the step, so host work before
the first launch counts); "wall ms", wall clock from there until the device is idle (copies on
other streams included); "device ms, host ahead", CUDA events around a step whose launches were
all queued before the device reached it (a sleep kernel holds the device), as in a training loop
whose host runs ahead of the device; "host ms", the ``step()`` call's own wall time then.
"""
from __future__ import annotations

import argparse
import gc
import logging
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

import torch

from .measure import copy_bandwidths, device_name, state_bytes, sync

log = logging.getLogger("optstate")

LLAMA_1B = dict(vocab=32000, hidden=2048, ffn=5632, layers=22)


def llama_shapes(scale: float = 1.0, layers: Optional[int] = None):
    """Parameter shapes of a Llama-1B-like model (embedding, per layer 4 attn + 3 MLP + 2 norms,
    final norm, lm_head); every dimension multiplied by ``scale`` (rounded to 256)."""
    def dim(n):
        return max(256, int(round(n * scale / 256)) * 256)
    v, h, f = dim(LLAMA_1B["vocab"]), dim(LLAMA_1B["hidden"]), dim(LLAMA_1B["ffn"])
    shapes = [(v, h)]
    for _ in range(layers if layers is not None else LLAMA_1B["layers"]):
        shapes += [(h, h)] * 4 + [(f, h)] * 3 + [(h,), (h,)]
    return shapes + [(h,), (v, h)]


@dataclass
class Config:
    name: str
    build: Callable[[List[torch.nn.Parameter]], torch.optim.Optimizer]
    offloaded: bool = False
    weights: torch.dtype = torch.float32  # bf16: master-weight presets (bf16 parameters + correction)


#: the master-weight presets timed as rows of the table (bf16 parameters + correction)
MASTER_PRESETS = ("bf16w-8bit", "bf16w-4bit", "bf16w-8bit-lean", "bf16w-4bit-lean", "bf16w-4bit-lean-hostcorr")
THIRD_PARTY_NAMES = ("bnb8", "bnb_paged8", "ao8", "ao4")


def _wrapped(preset: str, **options):
    def build(params):
        from ..presets import make_policy, wrap
        inner = torch.optim.AdamW(params, fused=params[0].is_cuda or None)
        return wrap(inner, make_policy(preset), **options)
    return build


def _wrapped_policy(make, **options):
    def build(params):
        from ..presets import wrap
        return wrap(torch.optim.AdamW(params, fused=params[0].is_cuda or None), make(), **options)
    return build


def configs(device: torch.device, compare: bool, budget_fraction: float) -> Dict[str, Config]:
    fused = device.type == "cuda"
    out = {
        "torch AdamW fused" if fused else "torch AdamW foreach":
            Config("adamw", lambda ps: torch.optim.AdamW(ps, fused=fused or None, foreach=None if fused else True)),
        "optstate fp32": Config("fp32", _wrapped("fp32")),
        "optstate bf16": Config("bf16", _wrapped("bf16")),
        "optstate int8": Config("int8", _wrapped("8bit")),
        "optstate int8, nearest rounding": Config("int8_nearest", _wrapped_policy(
            lambda: __import__("optstate_core").make_policy("8bit", momentum_codec="int8", variance_codec="int8"))),
        "optstate 4bit": Config("4bit", _wrapped("4bit")),
        "optstate 4bit, nearest rounding": Config("4bit_nearest", _wrapped_policy(
            lambda: __import__("optstate_core").make_policy("4bit", momentum_codec="int4", variance_codec="int4"))),
        "optstate int8 offloaded": Config("int8_offload", _wrapped("8bit", offload=True), offloaded=True),
        "optstate fp32 offloaded": Config("fp32_offload", _wrapped("fp32", offload=True), offloaded=True),
        "optstate fp32, skip_nonfinite=False": Config("fp32_nocheck", _wrapped("fp32", skip_nonfinite=False)),
        "optstate fp32, check_in_backward=True": Config("fp32_bwcheck", _wrapped("fp32", check_in_backward=True)),
        "optstate int8, skip_nonfinite=False": Config("int8_nocheck", _wrapped("8bit", skip_nonfinite=False)),
        "optstate 4bit, skip_nonfinite=False": Config("4bit_nocheck", _wrapped("4bit", skip_nonfinite=False)),
    }
    for preset in MASTER_PRESETS:
        out[f"optstate {preset}"] = Config(preset, _wrapped(preset), offloaded=preset.endswith("hostcorr"),
                                           weights=torch.bfloat16)
    out.update(_other_optimizers(device))
    if compare:
        out.update(_third_party(device))
    return out


def _other_optimizers(device) -> Dict[str, Config]:
    """Rows for the third-party optimizers with an ``optim`` name (when installed): lion-pytorch's
    Lion (its torch update and its own Triton kernel) and schedule-free AdamW (foreach), each
    unwrapped and wrapped (names ``lion``, ``lion_triton``, ``lion_<preset>``, ``sf``,
    ``sf_<preset>``); schedule-free is put in train mode when built."""
    from ..presets import wrap
    out = {}
    try:
        from lion_pytorch import Lion
    except ImportError:
        Lion = None
    if Lion is not None:
        out["lion-pytorch Lion"] = Config("lion", lambda ps: Lion(ps, lr=1e-4, weight_decay=0.1))
        if device.type == "cuda":
            out["lion-pytorch Lion, its Triton kernel"] = Config(
                "lion_triton", lambda ps: Lion(ps, lr=1e-4, weight_decay=0.1, use_triton=True))
        for preset in ("fp32", "8bit", "4bit"):
            out[f"optstate Lion {preset}"] = Config(
                f"lion_{preset}", lambda ps, preset=preset: wrap(Lion(ps, lr=1e-4, weight_decay=0.1), preset))
    try:
        from schedulefree import AdamWScheduleFree
    except ImportError:
        return out

    def schedule_free(preset=None):
        def build(ps):
            inner = AdamWScheduleFree(ps, lr=1e-3, weight_decay=0.1)
            opt = inner if preset is None else wrap(inner, preset)
            opt.train()
            return opt
        return build

    out["schedulefree AdamW (foreach)"] = Config("sf", schedule_free())
    for preset in ("fp32", "8bit", "8bit-it24", "4bit-it24"):
        out[f"optstate schedule-free AdamW {preset}"] = Config(f"sf_{preset.replace('-', '_')}",
                                                             schedule_free(preset))
    return out


def _third_party(device) -> Dict[str, Config]:
    out = {}
    try:
        import bitsandbytes as bnb  # noqa: F401
        out["bitsandbytes AdamW8bit"] = Config("bnb8", lambda ps: bnb.optim.AdamW8bit(ps))
        out["bitsandbytes PagedAdamW8bit"] = Config("bnb_paged8", lambda ps: bnb.optim.PagedAdamW8bit(ps))
    except Exception as e:  # not installed or no GPU build
        log.info("bitsandbytes not available: %s", e)
    try:
        from torchao.optim import AdamW4bit, AdamW8bit
        out["torchao AdamW8bit"] = Config("ao8", lambda ps: AdamW8bit(ps))
        out["torchao AdamW4bit"] = Config("ao4", lambda ps: AdamW4bit(ps))
    except Exception as e:
        log.info("torchao not available: %s", e)
    return out


def bench_one(cfg: Config, shapes, device, steps: int, warmup: int, seed: int = 0, backward: bool = False) -> dict:
    """Time ``cfg``'s step on Llama-shaped parameters; with ``backward``, every step's gradients
    come from an (untimed in the step) autograd backward, so backward hooks run as in training."""
    gc.collect()  # the previous configuration's memory must not be freed inside this one's window
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
    gen = torch.Generator(device=device).manual_seed(seed)
    # bf16 rows: the same values rounded to bf16; the master correction starts at zero (no
    # cast_model seeds, whose memory the first step frees, would skew the bytes held)
    params = [torch.nn.Parameter((torch.randn(s, device=device, generator=gen) * 0.02).to(cfg.weights))
              for s in shapes]
    for p in params:
        p.grad = (torch.randn(p.shape, device=device, generator=gen) * 1e-3).to(p.dtype)
    n = sum(p.numel() for p in params)
    opt = cfg.build(params)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    fixed = [p.grad for p in params]
    backward_ms = []

    def new_grads(params=params):  # a backward yielding the same gradients: AccumulateGrad and its hooks run
        if backward:
            sync(device)
            t = time.perf_counter()
            for p in params:
                p.grad = None
            torch.autograd.backward(params, fixed)
            sync(device)
            backward_ms.append((time.perf_counter() - t) * 1e3)

    for _ in range(warmup):
        new_grads()
        opt.step()
    sync(device)
    held = torch.cuda.memory_allocated(device) - base if device.type == "cuda" else state_bytes(opt)
    if backward and device.type == "cuda":  # the backward's gradients sit beside the kept ``fixed`` ones
        held -= sum(g.numel() * g.element_size() for g in fixed)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    times, walls = [], []  # CUDA events on the compute stream; wall clock until the device is idle
    for _ in range(steps):
        new_grads()
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(device)
            t = time.perf_counter()
            start.record()
            opt.step()
            end.record()
            torch.cuda.synchronize(device)  # includes write-backs queued on copy streams
            walls.append((time.perf_counter() - t) * 1e3)
            times.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            opt.step()
            times.append((time.perf_counter() - t) * 1e3)
            walls.append(times[-1])
    peak = torch.cuda.max_memory_allocated(device) - before if device.type == "cuda" else float("nan")
    device_ms, host_ms = _host_ahead(opt, new_grads, steps) if device.type == "cuda" else (times, times)
    report = opt.memory_report() if hasattr(opt, "memory_report") else None
    encoded = report["state_bytes"] if report else None
    del opt, params
    gc.collect()
    return {"n_params": n, "weights": str(cfg.weights).replace("torch.", ""),
            "bits_per_param": 8.0 * held / n, "step_ms": statistics.median(times),
            "wall_ms": statistics.median(walls),
            "device_ms": statistics.median(device_ms), "host_ms": statistics.median(host_ms),
            "backward_ms": statistics.median(backward_ms[warmup:]) if backward else None,
            "peak_extra_bytes": peak, "encoded_bytes": encoded, "host_bytes": report["host_bytes"] if report else None,
            "encoded_bits_per_param": 8.0 * report["device_bytes"] / n if report else None}


#: GPU cycles the device sleeps before a "host ahead" step (~50 ms at 2 GHz): longer than any
#: step's host work before its first launch, so every launch is queued when the device gets there
HOLD_CYCLES = 100_000_000


def _host_ahead(opt, new_grads, steps: int):
    """Per step: the device time of ``step()`` when the host runs ahead, as in a training loop
    (the device is held busy by a sleep kernel until the host has queued the whole step; CUDA
    events around the step on the compute stream), and the host time of the ``step()`` call."""
    device_ms, host_ms = [], []
    for _ in range(steps):
        new_grads()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        torch.cuda._sleep(HOLD_CYCLES)
        start.record()
        t = time.perf_counter()
        opt.step()
        host_ms.append((time.perf_counter() - t) * 1e3)
        end.record()
        torch.cuda.synchronize()
        device_ms.append(start.elapsed_time(end))
    return device_ms, host_ms


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--scale", type=float, default=None,
                        help="multiply every Llama-1B dimension by this (default: 1.0 on CUDA, 0.125 on CPU)")
    parser.add_argument("--layers", type=int, default=None, help="number of layers (default: 22)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per configuration (median reported)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed warm-up steps per configuration")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    parser.add_argument("--configs", default=None,
                        help="comma-separated subset of configuration short names (adamw,fp32,bf16,int8,4bit,"
                             "int8_offload, ...; the master-weight presets " + ",".join(MASTER_PRESETS) +
                             "; with --compare also " + ",".join(THIRD_PARTY_NAMES) + "); adamw is always run")
    parser.add_argument("--compare", action="store_true", help="add bitsandbytes / torchao when installed")
    parser.add_argument("--backward", action="store_true",
                        help="produce every step's gradients with an autograd backward (backward hooks run, as in "
                             "training: the fp32 path's NaN/inf check moves there); adds its wall ms")
    parser.add_argument("--tune", default=None,
                        help="kernel launch shapes to try for the fused configurations, e.g. '2x4,4x4,1x1x16x64' "
                             "(tiles of 256 per program x warps [x tiles looped over [x register cap]]); "
                             "each adds rows")
    parser.add_argument("--json", default=None, help="also write the results as JSON to this file")
    parser.add_argument("--budget-fraction", type=float, default=1 / 16,
                        help="gpu_budget for budgeted configurations, as a fraction of fp32 AdamW state")
    from . import capacity, e2e, peakbytes
    e2e.add_arguments(parser)
    capacity.add_arguments(parser)
    peakbytes.add_arguments(parser)


def tune_shape(item: str) -> tuple:
    """A ``--tune`` item, ``TILESxWARPS[xLOOPS[xREGISTERS]]``, as (NBLK, num_warps, ITERS, maxnreg)
    (loops default to 1, the register cap to none: 0)."""
    parts = item.strip().split("x")
    if not 2 <= len(parts) <= 4 or not all(p.isdigit() for p in parts) or not all(int(p) > 0 for p in parts[:3]):
        raise ValueError(f"--tune: {item!r} is not TILESxWARPS[xLOOPS[xREGISTERS]] with positive integers")
    nblk, warps, iters, regs = (int(p) for p in parts + ["1", "0"][len(parts) - 2:])
    return nblk, warps, iters, regs


def run(args) -> int:
    for mode, batch, seq, steps in (("capacity", 4, 512, 3), ("peak_bytes", 1, 2048, 3), ("e2e", 8, 512, None)):
        if getattr(args, mode, False):  # each mode's defaults for the options they share
            args.batch, args.seq = args.batch or batch, args.seq or seq
            args.steps = args.steps or steps
            break
    if getattr(args, "capacity", False):
        from . import capacity
        return capacity.run_capacity(args)
    if getattr(args, "peak_bytes", False):
        from . import peakbytes
        return peakbytes.run_peak_bytes(args)
    if getattr(args, "e2e", False):
        from . import e2e
        args.layers = args.layers_e2e
        return e2e.run_e2e(args)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    scale = args.scale if args.scale is not None else (1.0 if device.type == "cuda" else 0.125)
    shapes = llama_shapes(scale, args.layers)
    table = configs(device, args.compare, args.budget_fraction)
    if args.configs:
        wanted = {n.strip() for n in args.configs.split(",") if n.strip()}
        known = {c.name for c in configs(device, False, args.budget_fraction).values()} | set(THIRD_PARTY_NAMES)
        unknown = sorted(wanted - known)
        if unknown:
            raise ValueError(f"--configs: unknown configuration {', '.join(unknown)} (valid: {', '.join(sorted(known))})")
        table = {k: v for k, v in table.items() if v.name in wanted or v.name == "adamw"}
    rates = copy_bandwidths(device)
    bandwidth = (rates["mean"], rates["duplex"])
    rows = []
    from ..step import fused_launch as fused
    shapes_to_try = [None]
    if args.tune:
        shapes_to_try = [tune_shape(item) for item in args.tune.split(",")]
    defaults = dict(fused.LAUNCH_SHAPES)
    for label, cfg in table.items():
        variants = shapes_to_try if cfg.name not in ("adamw",) and not cfg.name.startswith(("bnb", "ao")) else [None]
        for variant in variants:
            name = label
            if variant is not None:
                fused.LAUNCH_SHAPES.update({kind: variant for kind in defaults})
                if len(variants) > 1:
                    name = f"{label} [{variant[0]}x256, {variant[1]} warps, {variant[2]} loops, {variant[3] or 'any'} regs]"
            log.info("bench: %s", name)
            try:
                r = bench_one(cfg, shapes, device, args.steps, args.warmup, backward=args.backward)
            except Exception as e:  # keep the table going; report the failure in its row
                log.warning("bench: %s failed: %s", name, e)
                rows.append((name, cfg, None))
                continue
            rows.append((name, cfg, r))
    fused.LAUNCH_SHAPES.update(defaults)
    print_table(rows, device, bandwidth)
    if args.json:
        import json
        with open(args.json, "w") as f:
            json.dump({"device": device_name(device), "torch": torch.__version__, "bandwidth": bandwidth[0],
                       "duplex_bandwidth": bandwidth[1],
                       "rows": [{"config": n, **(r or {})} for n, _, r in rows]}, f, indent=1)
    return 0


def print_table(rows, device, bandwidth) -> None:
    """The step table; ``bandwidth``: (one-way, per-direction duplex) pinned bytes/s."""
    one_way, duplex = bandwidth
    ref = next((r for _, c, r in rows if c.name == "adamw" and r), None)
    n = next((r["n_params"] for _, _, r in rows if r), 0)
    print(f"\noptimizer step, {n / 1e9:.3f}B params, device {device_name(device)}, "
          f"torch {torch.__version__}")
    head = f"| {'configuration':<34} | params | state bits/param | encoded bits/param | step ms | " \
           f"x {'fused' if device.type == 'cuda' else 'foreach'} | wall ms | x (wall) | device ms, host ahead | x (ahead) " \
           f"| host ms | peak extra MB | PCIe floor ms (one way / duplex) | x floor |"
    if any(r and r.get("backward_ms") is not None for _, _, r in rows):
        head += " backward ms (before the step, wall until idle) |"
    print(head)
    print("|" + "|".join("-" * len(c) for c in head.split("|")[1:-1]) + "|")
    for label, cfg, r in rows:
        if r is None:
            print(f"| {label:<34} | | failed | | | | | | | | | | | |")
            continue
        ratio = r["step_ms"] / ref["step_ms"] if ref else float("nan")
        wall_ratio = r["wall_ms"] / ref["wall_ms"] if ref else float("nan")
        ahead_ratio = r["device_ms"] / ref["device_ms"] if ref else float("nan")
        floor, x_floor = "", ""
        if cfg.offloaded and r.get("host_bytes") and one_way == one_way:  # S up while S comes back down
            floors = [r["host_bytes"] / bw * 1e3 for bw in (one_way, duplex)]
            floor = f"{floors[0]:.1f} / {floors[1]:.1f}"
            x_floor = f"{r['step_ms'] / floors[0]:.2f} / {r['step_ms'] / floors[1]:.2f}"
        peak = "" if r["peak_extra_bytes"] != r["peak_extra_bytes"] else f"{r['peak_extra_bytes'] / 2**20:.0f}"
        enc = "" if r.get("encoded_bits_per_param") is None else f"{r['encoded_bits_per_param']:.2f}"
        print(f"| {label:<34} | {r['weights'].replace('float32', 'fp32').replace('bfloat16', 'bf16'):>6} |"
              f" {r['bits_per_param']:15.2f} | {enc:>18} | {r['step_ms']:7.2f} | {ratio:7.2f} |"
              f" {r['wall_ms']:7.2f} | {wall_ratio:8.2f} | {r['device_ms']:21.2f} | {ahead_ratio:9.2f} |"
              f" {r['host_ms']:7.2f} | {peak:>13} | {floor:>31} | {x_floor:>7} |"
              + ("" if r.get("backward_ms") is None else f" {r['backward_ms']:.2f} |"))
    if any(c.weights != torch.float32 for _, c, r in rows if r):
        print("bf16 rows: bf16 parameters and gradients with fp32 master weights kept as state; their "
              "state bits include the master correction")
    if one_way == one_way:
        print(f"pinned host<->device bandwidth: {one_way / 1e9:.1f} GB/s one way, {duplex / 1e9:.1f} GB/s per "
              "direction with both at once; PCIe floor of a configuration with host-tier state = its host-tier "
              "bytes S / that bandwidth (S goes up while the previous chunks come back: the duplex rate applies)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="optstate bench", description=__doc__)
    add_arguments(parser)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
