"""The largest model on one GPU: ``optstate bench --capacity``.

For each optimizer (``--optimizers``, names as in :mod:`optstate_core.apps.contenders`) find the
largest Llama-shaped model that trains one step (forward + backward + step at ``--batch`` x
``--seq``, activation checkpointing unless ``--no-checkpointing``) without running out of GPU
memory. Models grow along a ladder sorted by parameter count: layers at the first width
(``--widths``, default 2048), then the next width from the first layer count that is larger than
the previous width's largest, and so on. The search doubles the parameter count until a trial
fails, then bisects (geometric midpoint on the ladder) until the bracket is within
``--resolution`` or ``--max-trials`` is spent; each optimizer gets an equal share of what is left
of ``--time-budget``. Every trial runs in a fresh subprocess with ``--trial-timeout`` (a timeout
counts as "does not fit"). The table reports the largest model that fit, the smallest that did
not, its median step time (wall clock until the device is idle), tokens/s and peak GPU memory.
"""
from __future__ import annotations

import json
import logging
import math
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import torch

from .llama import LlamaShape
from .trial import NOT_FIT, TrialSpec, run_in_subprocess

log = logging.getLogger("optstate")

DEFAULT_OPTIMIZERS = ("adamw,bnb8,ao_offload,8bit,4bit,offload,bf16w-8bit,bf16w-4bit-lean,"
                      "bf16w-4bit-lean+offload")


def ladder(widths: List[int], max_layers: int, vocab: int, last_max_layers: int = 128) -> List[LlamaShape]:
    """Model shapes in increasing parameter count: layers 1..max_layers at each width (the last
    width up to ``last_max_layers``), each width starting above the previous width's largest."""
    out: List[LlamaShape] = []
    for i, width in enumerate(widths):
        top = last_max_layers if i == len(widths) - 1 else max_layers
        for layers in range(1, top + 1):
            shape = LlamaShape.grown(width, layers, vocab)
            if not out or shape.params > out[-1].params:
                out.append(shape)
    return out


@dataclass
class SearchResult:
    """Where the search ended: the largest index that fit, the smallest that did not, the trials."""
    fit: Optional[int] = None
    no_fit: Optional[int] = None
    trials: List[tuple] = field(default_factory=list)  # (index, status)
    error: Optional[str] = None


def search(sizes: List[int], fits: Callable[[int], str], start: int, max_trials: int, resolution: float,
           out_of_time: Callable[[], bool] = lambda: False,
           predict: Optional[Callable[[int], Optional[float]]] = None) -> SearchResult:
    """Doubling then bisection over a ladder of increasing ``sizes``. ``fits(i)`` returns a trial
    status: ``ok`` fits, ``oom``/``timeout`` does not, anything else stops the search.
    ``predict(i)``, if given, extrapolates the largest size that fits from fitting trial ``i``
    (e.g. from its peak memory): growth stops at the first size past it instead of doubling, and
    bisection tries it first (at most twice in a row, then a geometric midpoint)."""
    if not sizes:
        raise ValueError("search: the ladder is empty")
    r = SearchResult()
    i = min(max(start, 0), len(sizes) - 1)
    guided = 0  # consecutive bisection trials placed by predict()
    while len(r.trials) < max_trials:
        status = fits(i)
        r.trials.append((i, status))
        if status == "ok":
            r.fit = i
        elif status in NOT_FIT:
            r.no_fit = i
        else:
            r.error = status
            break
        if out_of_time():
            break
        guess = predict(r.fit) if predict is not None and r.fit is not None else None
        if r.no_fit is None:  # growing: double the parameter count (or up to just past the guess)
            if r.fit == len(sizes) - 1:
                break
            target = 2 * sizes[r.fit] if guess is None else min(2 * sizes[r.fit], guess)
            i = next((j for j in range(r.fit + 1, len(sizes)) if sizes[j] >= target), len(sizes) - 1)
        elif r.fit is None:  # shrinking: halve it
            if r.no_fit == 0:
                break
            i = max((j for j in range(r.no_fit) if sizes[j] <= sizes[r.no_fit] / 2), default=0)
        else:  # bisect between the largest fit and the smallest failure
            if r.no_fit - r.fit <= 1 or sizes[r.no_fit] <= sizes[r.fit] * (1 + resolution):
                break
            inside = range(r.fit + 1, r.no_fit)
            if guess is not None and guided < 2 and sizes[r.fit] < guess < sizes[r.no_fit]:
                i = next((j for j in inside if sizes[j] >= guess), r.no_fit - 1)
                guided += 1
            else:
                mid = math.sqrt(sizes[r.fit] * sizes[r.no_fit])
                i = min(inside, key=lambda j: abs(math.log(sizes[j] / mid)))
                guided = 0
    return r


def start_index(sizes: List[int], hint_bytes_per_param: float, gpu_bytes: Optional[int]) -> int:
    """Where to begin: the largest model whose rough footprint fills 60% of the GPU (1B if unknown)."""
    target = 0.6 * gpu_bytes / hint_bytes_per_param if gpu_bytes else 1e9
    return max((j for j, n in enumerate(sizes) if n <= target), default=0)


def gpu_memory_bytes(device: str) -> Optional[int]:
    """The GPU's total memory from nvidia-smi (this process never initializes CUDA), or None."""
    if not device.startswith("cuda") or shutil.which("nvidia-smi") is None:
        return None
    index = device.partition(":")[2] or "0"
    try:
        text = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits",
                               "-i", index], capture_output=True, text=True, timeout=20).stdout
        return int(float(text.strip().splitlines()[0]) * 2**20)
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return None


RESERVED_BYTES = 1.5 * 2**30  # CUDA context and library workspaces, outside max_memory_allocated


def run_capacity(args, runner: Callable[[TrialSpec, float], dict] = run_in_subprocess) -> int:
    from . import contenders

    names = [n.strip() for n in (args.optimizers or DEFAULT_OPTIMIZERS).split(",") if n.strip()]
    chosen = [contenders.parse(n) for n in names]  # a bad name fails before any trial
    shapes = ladder([int(w) for w in args.widths.split(",")], args.max_layers, args.vocab)
    device = args.device or "cuda"
    gpu = args.gpu_memory_bytes or gpu_memory_bytes(device)
    deadline = time.monotonic() + args.time_budget
    rows = []
    for k, c in enumerate(chosen):
        missing = contenders.unavailable(c)
        left = deadline - time.monotonic()
        if missing or left <= 0:
            rows.append({"optimizer": c.name, "status": "unavailable" if missing else "skipped",
                         "error": missing or "--time-budget spent"})
            log.info("capacity: %s", table_row(rows[-1]))
            continue
        row = _search_one(c, shapes, args, device, gpu, time.monotonic() + left / (len(chosen) - k), deadline,
                          runner)
        gpu = gpu or row["result"].get("gpu_total_bytes")
        rows.append(row)
        log.info("capacity: %s", table_row(row))
    print_table(rows, args, gpu)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "gpu_total_bytes": gpu, "batch": args.batch, "seq": args.seq,
                       "checkpointing": args.checkpointing, "rows": rows}, f, indent=1)
    return 0


def _search_one(c, shapes, args, device, gpu, share_end, deadline, runner) -> dict:
    """The search for one optimizer; returns its table row."""
    from . import contenders

    sizes = [s.params for s in shapes]
    results: Dict[int, dict] = {}
    last = [0.0]  # the last trial's seconds: stop early rather than overrun the share

    def fits(i):
        spec = TrialSpec(shapes[i].to_dict(), c.name, args.batch, args.seq, args.checkpointing, device, args.steps, 1)
        log.info("capacity: %s at %.2fB params (%s)", c.name, sizes[i] / 1e9, shapes[i].describe())
        t = time.monotonic()
        results[i] = runner(spec, min(args.trial_timeout, max(30.0, deadline + 30.0 - t)))
        last[0] = time.monotonic() - t
        log.info("capacity:   -> %s in %.0f s %s", results[i]["status"], last[0], results[i].get("error", ""))
        return results[i]["status"]

    def predict(i):  # linear in parameters from the peak of a trial that fit (an underestimate)
        r = results.get(i, {})
        total = r.get("gpu_total_bytes") or gpu
        if not r.get("peak_bytes") or not total:
            return None
        return sizes[i] * (total - RESERVED_BYTES) / r["peak_bytes"]

    start = start_index(sizes, contenders.hint_bytes_per_param(c), gpu)
    found = search(sizes, fits, start, args.max_trials, args.resolution,
                   out_of_time=lambda: time.monotonic() + last[0] > share_end, predict=predict)
    return {"optimizer": c.name, "status": found.error or ("ok" if found.fit is not None else "none fits"),
            "fit": shapes[found.fit].to_dict() if found.fit is not None else None,
            "no_fit": shapes[found.no_fit].to_dict() if found.no_fit is not None else None,
            "params": sizes[found.fit] if found.fit is not None else None,
            "no_fit_params": sizes[found.no_fit] if found.no_fit is not None else None,
            "no_fit_status": results[found.no_fit]["status"] if found.no_fit is not None else None,
            "at_ladder_top": found.fit == len(sizes) - 1, "trials": len(found.trials),
            "result": results.get(found.fit, {}),
            "error": next((r.get("error") for r in results.values() if r["status"] not in ("ok",) + NOT_FIT), None)}


def _gb(n) -> str:
    return "" if n is None else f"{n / 1e9:.2f}"


def table_row(row: dict) -> str:
    """One markdown row (also logged as soon as the optimizer is done, so a killed run keeps it)."""
    if row["status"] not in ("ok", "none fits"):
        return f"| {row['optimizer']} | {row['status']}: {row.get('error') or ''} | | | | | | {row.get('trials', '')} |"
    r = row["result"]
    shape = "" if row["fit"] is None else f"{row['fit']['hidden']} x {row['fit']['layers']} layers"
    more = " (ladder top)" if row["at_ladder_top"] else ""
    status = row["no_fit_status"]
    why = f" ({status.upper() if status == 'oom' else status})" if status else ""
    peak = "" if r.get("peak_bytes") is None else f"{r['peak_bytes'] / 2**30:.1f}"
    step = "" if r.get("step_s") is None else f"{r['step_s']:.3f}"
    tps = "" if r.get("tokens_per_s") is None else f"{r['tokens_per_s']:.0f}"
    return (f"| {row['optimizer']} | {_gb(row['params']) or 'none'}{more} | {shape} | {_gb(row['no_fit_params'])}{why} "
            f"| {step} | {tps} | {peak} | {row['trials']} |")


def print_table(rows, args, gpu) -> None:
    total = f"{gpu / 2**30:.0f} GiB GPU" if gpu else f"device {args.device or 'cuda'}"
    print(f"\nlargest Llama-shaped model that trains on one {total}: batch {args.batch}x{args.seq}, "
          f"activation checkpointing {'on' if args.checkpointing else 'off'}, vocab {args.vocab}, "
          f"widths {args.widths}; torch {torch.__version__}")
    print("| optimizer | largest that fits (B params) | shape | first that did not (B) | step s | tokens/s "
          "| peak GPU GiB | trials |")
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    for row in rows:
        print(table_row(row))
    print("step s: median of the timed steps of the largest model that fit (wall clock until the device is idle); "
          "peak: torch.cuda.max_memory_allocated over the whole trial; a trial past --trial-timeout counts as "
          "not fitting")


def add_arguments(parser) -> None:
    g = parser.add_argument_group("--capacity (the largest model on one GPU)")
    g.add_argument("--capacity", action="store_true", help="find the largest model each optimizer can train")
    g.add_argument("--optimizers", default=None,
                   help=f"comma-separated optimizer names (--capacity default: {DEFAULT_OPTIMIZERS}; "
                        "--peak-bytes default: adamw, the bf16w-* presets (-hostcorr first), flashoptim, flashoptim+release; "
                        "unavailable ones are reported as such)")
    g.add_argument("--widths", default="2048,4096,8192", help="hidden sizes of the ladder (default: %(default)s)")
    g.add_argument("--max-layers", type=int, default=32, help="layers at each width but the last (default: 32)")
    g.add_argument("--max-trials", type=int, default=6, help="trials per optimizer at most (default: 6)")
    g.add_argument("--resolution", type=float, default=0.1,
                   help="stop bisecting when the first failure is within this fraction of the largest fit")
    g.add_argument("--time-budget", type=float, default=480.0, help="seconds for the whole table (default: 480)")
    g.add_argument("--trial-timeout", type=float, default=120.0, help="seconds per trial (default: 120)")
    g.add_argument("--gpu-memory-bytes", type=int, default=None, help="GPU memory, only to pick where to start")
    g.add_argument("--checkpointing", action=__import__("argparse").BooleanOptionalAction, default=True,
                   help="activation checkpointing in --capacity and --peak-bytes trials (default: on)")
