"""GPU bytes per parameter at a training step's peak: ``optstate bench --peak-bytes`` (issue 14).

For each model (``--models``: ``0.95b`` = e2e.py's config, ``8b`` = a Llama-3-8B-shaped config,
``tiny`` for tests) and each optimizer (``--optimizers``), one subprocess builds the model from
its config (random init), runs ``--steps`` timed training steps after one warm-up at ``--batch`` x
``--seq`` (activation checkpointing unless ``--no-checkpointing``) and reports the peak of the
timed steps (``torch.cuda.max_memory_allocated``), step time and tokens/s; an OOM is a result.

Bytes per parameter at the peak count what the training state holds there, not activations:
``(peak - A) / params``, where ``A`` = peak - weight bytes of the same forward + backward with no
optimizer and every gradient freed in its hook (``none`` for fp32 weights under bf16 autocast,
``none-bf16`` for bf16 weights: same model, same batch). So it is weights + gradients alive at
the peak + optimizer state (+ master correction) + the optimizer's own step temporaries. "held"
is what stays allocated between steps (weights + state) per parameter; "host" the optimizer state
kept in host memory per parameter (``memory_report()``: e.g. the ``-hostcorr`` presets' correction).
"""
from __future__ import annotations

import json
import logging

import torch

from .llama import NAMED_SHAPES, LlamaShape
from .trial import TrialSpec, run_in_subprocess

log = logging.getLogger("optstate")

DEFAULT_OPTIMIZERS = ("adamw,bf16w-4bit-lean-hostcorr,bf16w-8bit-lean-hostcorr,bf16w-4bit-lean,bf16w-8bit-lean,"
                      "bf16w-4bit,bf16w-8bit,flashoptim,flashoptim+release")


def baseline_of(name: str) -> str:
    """The forward+backward-only run that measures the activations for this optimizer's rows."""
    from . import contenders
    return "none" if contenders.parse(name).weights == torch.float32 else "none-bf16"


def run_peak_bytes(args, runner=run_in_subprocess) -> int:
    from . import contenders

    models = [m.strip() for m in args.models.split(",") if m.strip()]
    for m in models:
        if m not in NAMED_SHAPES:
            raise ValueError(f"--models: unknown model {m!r} (valid: {', '.join(NAMED_SHAPES)})")
    from ..state.units import parse_bytes
    cap = None if args.memory_cap is None else parse_bytes(args.memory_cap, "--memory-cap")
    if args.accumulate < 1:
        raise ValueError(f"--accumulate must be at least 1, got {args.accumulate}")
    names = [n.strip() for n in (args.optimizers or DEFAULT_OPTIMIZERS).split(",") if n.strip()]
    for n in names:
        contenders.parse(n)
    rows = []
    for m in models:
        shape = NAMED_SHAPES[m]
        baselines = {}
        for name in [b for b in ("none", "none-bf16") if b in {baseline_of(n) for n in names}] + names:
            c = contenders.parse(name)
            missing = contenders.unavailable(c)
            if missing:
                r = {"status": "unavailable", "error": missing, "params": shape.params}
            else:
                log.info("peak-bytes: %s, %s", m, name)
                spec = TrialSpec(shape.to_dict(), name, args.batch, args.seq, args.checkpointing,
                                 args.device or "cuda", args.steps, 1, memory_cap=cap, accumulate=args.accumulate)
                r = runner(spec, args.trial_timeout)
                log.info("peak-bytes:   -> %s %s", r["status"], r.get("error", ""))
            if name.startswith("none"):
                baselines[name] = r
                continue
            rows.append(summarize(m, shape, name, r, baselines.get(baseline_of(name))))
            log.info("peak-bytes: %s", table_row(rows[-1]))
    print_table(rows, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "batch": args.batch, "seq": args.seq,
                       "checkpointing": args.checkpointing, "memory_cap": args.memory_cap,
                       "accumulate": args.accumulate, "rows": rows}, f, indent=1)
    return 0


def summarize(model: str, shape: LlamaShape, name: str, r: dict, base) -> dict:
    """One table row: the trial's figures and the bytes/param derived from it and its baseline."""
    n = shape.params
    error = r.get("error") if not r.get("failed_in") else f"{r['failed_in']}: {r.get('error')}"
    row = {"model": model, "params": n, "optimizer": name, "status": r["status"], "error": error,
           "peak_first_bytes": r.get("peak_first_bytes"), "steps_allocated_bytes": r.get("steps_allocated_bytes"),
           "step_s": r.get("step_s"), "tokens_per_s": r.get("tokens_per_s"), "peak_bytes": r.get("peak_step_bytes"),
           "held_bytes": r.get("held_bytes"), "host_bytes": r.get("optimizer_host_bytes"), "activation_bytes": None,
           "bytes_per_param_at_peak": None}
    if base and base.get("status") == "ok" and base.get("peak_step_bytes") is not None:
        row["activation_bytes"] = base["peak_step_bytes"] - base["weight_bytes"]
        if row["peak_bytes"] is not None:
            row["bytes_per_param_at_peak"] = (row["peak_bytes"] - row["activation_bytes"]) / n
    return row


def _cell(v, fmt, scale=1.0) -> str:
    return "" if v is None else format(v / scale, fmt)


def table_row(r: dict) -> str:
    """One markdown row (also logged as soon as it is measured, so a killed run keeps its rows)."""
    status = {"ok": "ok", "oom": "OOM"}.get(r["status"], f"{r['status']}: {r.get('error') or ''}")
    return (f"| {r['model']} ({r['params'] / 1e9:.2f}B) | {r['optimizer']} | {status} "
            f"| {_cell(r['peak_bytes'], '.2f', 2**30)} | {_cell(r['activation_bytes'], '.2f', 2**30)} "
            f"| {_cell(r['bytes_per_param_at_peak'], '.2f')} | {_cell(r['held_bytes'], '.2f', r['params'])} "
            f"| {_cell(r['step_s'], '.3f')} | {_cell(r['tokens_per_s'], '.0f')} "
            f"| {_cell(r.get('host_bytes'), '.2f', r['params'])} |")


def print_table(rows, args) -> None:
    cap = "" if args.memory_cap is None else f", GPU memory capped at {args.memory_cap}"
    print(f"\ntraining-step memory: batch {args.batch}x{args.seq}, {args.accumulate} micro-batch(es) per step, "
          f"activation checkpointing {'on' if args.checkpointing else 'off'}, random init from config{cap}; "
          f"torch {torch.__version__}")
    print("| model | optimizer | status | peak GPU GiB | activations GiB | B/param at peak | held B/param "
          "| step s | tokens/s | host B/param |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(table_row(r))
    print("B/param at peak = (peak of the timed steps - activations) / params; activations = peak - weights of a "
          "forward+backward with no optimizer and gradients freed in their hooks (fp32 weights + bf16 autocast, "
          "whose bf16 weight copies count as activations, for adamw; bf16 weights otherwise); held = allocated "
          "between steps / params; host = optimizer state in host memory / params")


def add_arguments(parser) -> None:
    g = parser.add_argument_group("--peak-bytes (bytes per parameter at the step's peak)")
    g.add_argument("--peak-bytes", action="store_true", help="measure peak memory per optimizer and model")
    g.add_argument("--models", default="0.95b,8b", help=f"of {', '.join(NAMED_SHAPES)} (default: %(default)s)")
    g.add_argument("--memory-cap", default=None,
                   help="GPU memory each trial may allocate, e.g. 24GB: torch.cuda.set_per_process_memory_fraction "
                        "on a larger card (default: the whole card)")
    g.add_argument("--accumulate", type=int, default=1,
                   help="micro-batches per optimizer step (gradient accumulation; release on the last)")
