"""``optstate compat``: which ``torch.optim`` optimizers wrap with which preset, the state they keep
and how close each stays to the unwrapped optimizer (writes docs/compatibility.md).

The task is fixed and small: a 64-256-256-8 GELU MLP (no biases for Muon, which takes matrices
only) learns a fixed random teacher MLP plus noise (variance 0.01) from 4096 samples in batches of
128, for ``--steps`` steps. Every optimizer runs unwrapped and wrapped with each preset from the
same initial weights on the same batches, for seeds 0 .. ``--seeds``-1 (a seed changes the
student's initial weights and the data). The figure of merit is the held-out loss at the end
(1024 other samples) against the unwrapped optimizer's on the same seed.

``--thirdparty`` runs the same task for the optimizers of the third-party packages that are
installed (``thirdparty.py``: discovery, settings, reasons to skip one) with the presets fp32, 8bit,
4bit and offload, and says whether ``fp32`` is bit-identical to the unwrapped optimizer
(docs/compatibility-thirdparty.md).
"""
from __future__ import annotations

import argparse
import logging
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch

log = logging.getLogger("optstate.compat")

PRESETS_COMPARED = ("fp32", "bf16", "8bit", "4bit", "offload")
THIRDPARTY_PRESETS = ("fp32", "8bit", "4bit", "offload")
#: optimizer class name -> its options on the task (learning rates that train it in 60 steps)
SETTINGS: Dict[str, dict] = {
    "Adam": dict(lr=3e-3), "AdamW": dict(lr=3e-3, weight_decay=0.01), "Adamax": dict(lr=3e-3),
    "NAdam": dict(lr=3e-3), "RAdam": dict(lr=3e-3), "SGD": dict(lr=0.05, momentum=0.9),
    "RMSprop": dict(lr=1e-3), "Adagrad": dict(lr=0.05), "Adadelta": dict(lr=1.0), "ASGD": dict(lr=0.05),
    "Rprop": dict(lr=1e-3), "Adafactor": dict(lr=1e-2), "Muon": dict(lr=0.02), "LBFGS": dict(lr=1.0),
    "SparseAdam": dict(lr=1e-3),
}
#: the verdict's bounds on the largest per-seed gap to the unwrapped optimizer
HOLDS, CLOSE = 2.0, 5.0
from .compat_task import BATCH, HELD_OUT, TRAIN, task  # noqa: E402,F401 (the task, shared with thirdparty.py)
from .thirdparty import one_line  # noqa: E402


def torch_optimizers() -> List[str]:
    """Every optimizer class this torch exports in ``torch.optim``."""
    return sorted(name for name, obj in vars(torch.optim).items()
                  if isinstance(obj, type) and issubclass(obj, torch.optim.Optimizer) and obj is not torch.optim.Optimizer)


@dataclass
class Run:
    """One optimizer under one preset (None: unwrapped) and one seed."""
    loss: float
    bits_per_param: Optional[float]
    initial: Optional[float] = None
    params: Optional[List[torch.Tensor]] = None


def run_one(name: str, preset: Optional[str], seed: int, steps: int, factory=None, bias: Optional[bool] = None) -> Run:
    """Train the task; raises what ``wrap`` raises for an optimizer it refuses. ``factory(model)``
    builds a third-party optimizer in place of ``torch.optim.<name>``; an optimizer with
    ``train()``/``eval()`` (schedule-free) is switched to train before the steps and to eval before
    the held-out loss (through the wrapper, which forwards them, when wrapped)."""
    from ..presets import wrap
    model, (x, y), (x_val, y_val), gen = task(seed, bias=name != "Muon" if bias is None else bias)
    with torch.no_grad():
        initial = float(torch.nn.functional.mse_loss(model(x_val), y_val))
    inner = getattr(torch.optim, name)(model.parameters(), **SETTINGS[name]) if factory is None else factory(model)
    opt = inner if preset is None else wrap(inner, preset)
    modes = callable(getattr(inner, "train", None)) and callable(getattr(inner, "eval", None))
    if modes:
        opt.train()
    for _ in range(steps):
        rows = torch.randint(0, TRAIN, (BATCH,), generator=gen)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
        opt.step()
    if modes:
        opt.eval()
    with torch.no_grad():
        loss = float(torch.nn.functional.mse_loss(model(x_val), y_val))
    bits = None if preset is None else opt.memory_report()["bits_per_param"]
    return Run(loss, bits, initial, [p.detach().clone() for p in model.parameters()])


@dataclass
class Row:
    """One optimizer x preset: refused (``reason``), or its per-seed gaps in percent."""
    optimizer: str
    preset: str
    reason: Optional[str] = None
    gaps: List[float] = field(default_factory=list)
    bits_per_param: Optional[float] = None
    loss: Optional[float] = None
    exact: Optional[bool] = None  # fp32 rows of --thirdparty: wrapped final weights torch.equal the unwrapped ones

    @property
    def verdict(self) -> str:
        if self.reason is not None:
            return "refused"
        worst = max(abs(g) for g in self.gaps)
        return "holds" if worst <= HOLDS else "close" if worst <= CLOSE else "degrades"


def compat_rows(optimizers: Sequence[str], presets: Sequence[str], seeds: int, steps: int,
                progress=None) -> Dict[str, dict]:
    """Per optimizer: the unwrapped losses per seed and a :class:`Row` per preset."""
    table = {}
    for name in optimizers:
        try:
            base = [run_one(name, None, s, steps).loss for s in range(seeds)]
        except Exception as e:  # the optimizer itself cannot run the task (e.g. SparseAdam on dense gradients)
            base, unwrapped_error = None, f"{type(e).__name__}: {e}"
        else:
            unwrapped_error = None
        rows = []
        for preset in presets:
            row = Row(name, preset)
            try:
                runs = [run_one(name, preset, s, steps) for s in range(seeds)]
            except ValueError as e:  # refused by wrap (or its first step) with a reason
                row.reason = str(e)
            except Exception as e:
                row.reason = f"{type(e).__name__}: {e}"
            else:
                if base is None:
                    row.reason = f"the unwrapped optimizer fails on this task ({unwrapped_error})"
                else:
                    row.gaps = [100 * (r.loss / b - 1) for r, b in zip(runs, base)]
                    row.bits_per_param = runs[0].bits_per_param
                    row.loss = statistics.fmean(r.loss for r in runs)
            rows.append(row)
            if progress is not None:
                progress.update(1)
        table[name] = {"base": base, "error": unwrapped_error, "rows": rows}
    return table


def thirdparty_rows(entries, presets: Sequence[str], seeds: int, steps: int, progress=None) -> Dict[str, dict]:
    """Per third-party optimizer (:class:`thirdparty.Entry`): why it is skipped, or the unwrapped losses per
    seed and a :class:`Row` per preset (the ``fp32`` row also says whether it is bit-identical)."""
    from .thirdparty import not_training
    table = {}
    for entry in entries:
        skip, base = entry.skip, None
        if skip is None:
            try:
                base = [run_one(entry.name, None, s, steps, factory=entry.factory, bias=entry.bias)
                        for s in range(seeds)]
            except Exception as e:
                skip = f"fails unwrapped: {type(e).__name__}: {one_line(e)}"
            else:
                skip = not_training([b.initial for b in base], [b.loss for b in base])
        if skip is not None:
            log.info("compat: %s skipped: %s", entry.name, skip)
            table[entry.name] = {"skip": skip, "base": None, "rows": [], "options": entry.options}
            if progress is not None:
                progress.update(len(presets))
            continue
        rows = []
        for preset in presets:
            row = Row(entry.name, preset)
            try:
                runs = [run_one(entry.name, preset, s, steps, factory=entry.factory, bias=entry.bias)
                        for s in range(seeds)]
            except ValueError as e:  # refused by wrap (or its first step) with a reason
                row.reason = str(e)
            except Exception as e:
                row.reason = f"{type(e).__name__}: {e}"
            else:
                row.gaps = [100 * (r.loss / b.loss - 1) for r, b in zip(runs, base)]
                row.bits_per_param = runs[0].bits_per_param
                row.loss = statistics.fmean(r.loss for r in runs)
                if preset == "fp32":
                    row.exact = all(torch.equal(p, q) for r, b in zip(runs, base) for p, q in zip(r.params, b.params))
            rows.append(row)
            if progress is not None:
                progress.update(1)
        table[entry.name] = {"skip": None, "base": [b.loss for b in base], "rows": rows, "options": entry.options}
    return table


def _thirdparty_one(args) -> Dict[str, dict]:
    """One optimizer's rows in a worker process (entries hold closures: each worker discovers its own)."""
    name, presets, seeds, steps = args
    from . import thirdparty as tp
    torch.set_num_threads(1)
    logging.getLogger("optstate").setLevel(logging.WARNING)
    return thirdparty_rows(tp.discover([name]), presets, seeds, steps)


def thirdparty_rows_parallel(names: Sequence[str], presets: Sequence[str], seeds: int, steps: int, jobs: int,
                             progress=None, on_result=None) -> Dict[str, dict]:
    """:func:`thirdparty_rows` over ``jobs`` processes, one optimizer per task; the table keeps ``names``' order.
    ``on_result(table so far)`` after each optimizer (to write partial results)."""
    from concurrent.futures import ProcessPoolExecutor, as_completed
    done = {}
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        futures = [pool.submit(_thirdparty_one, (name, list(presets), seeds, steps)) for name in names]
        for future in as_completed(futures):
            done.update(future.result())
            if progress is not None:
                progress.update(len(presets))
            if on_result is not None:
                on_result({name: done[name] for name in names if name in done})
    return {name: done[name] for name in names}


def recommendation(name: str, rows: List[Row]) -> str:
    """The smallest preset whose verdict holds, else the closest, in words."""
    if all(r.reason is not None for r in rows):
        return "cannot be wrapped: " + rows[0].reason.split(";")[0].removeprefix("optimizer: ")
    order = {r.preset: i for i, r in enumerate(rows)}  # ties: the earlier preset (fp32 first)
    holding = [r for r in rows if r.verdict == "holds" and r.bits_per_param is not None]
    if holding:
        best = min(holding, key=lambda r: (round(r.bits_per_param, 1), order[r.preset]))
        if all(round(r.bits_per_param, 1) == round(best.bits_per_param, 1) for r in rows if r.reason is None):
            return f"`{best.preset}`: no preset compresses its state on this task (its state stays fp32)"
        return f"`{best.preset}` (smallest state that holds the loss)"
    close = [r for r in rows if r.verdict == "close"]
    if close:
        best = min(close, key=lambda r: (round(r.bits_per_param, 1), order[r.preset]))
        return f"`{best.preset}` stays within {CLOSE:g}%; nothing smaller holds"
    return "no compressed preset holds its loss on this task"


def to_markdown(table: Dict[str, dict], seeds: int, steps: int, header: str = "") -> str:
    """docs/compatibility.md: one row per optimizer and preset, then a recommendation per optimizer."""
    out = [header.rstrip(), "", "| optimizer | preset | works | state bits/param | held-out loss (unwrapped) | "
           "gap per seed | verdict |", "|---|---|---|---:|---|---|---|"]
    for name, entry in table.items():
        for row in entry["rows"]:
            if row.reason is not None:
                out.append(f"| {name} | `{row.preset}` | no: {row.reason.splitlines()[0]} | | | | refused |")
                continue
            base = statistics.fmean(entry["base"])
            gaps = ", ".join(f"{g:+.2f}%" for g in row.gaps)
            out.append(f"| {name} | `{row.preset}` | yes | {row.bits_per_param:.1f} | {row.loss:.4f} ({base:.4f}) | "
                       f"{gaps} | {row.verdict} |")
    out += ["", "Recommendation per optimizer (smallest state whose every seed stays within "
            f"{HOLDS:g}% of the unwrapped loss):", ""]
    out += [f"- {name}: {recommendation(name, entry['rows'])}" for name, entry in table.items()]
    out += ["", f"Settings: {steps} steps, seeds 0-{seeds - 1}, torch {torch.__version__}; `holds`: every seed within "
            f"{HOLDS:g}% of the unwrapped optimizer's held-out loss, `close`: within {CLOSE:g}%, `degrades`: beyond."]
    return "\n".join(out) + "\n"


def thirdparty_markdown(table: Dict[str, dict], seeds: int, steps: int, header: str = "",
                        versions: Optional[Dict[str, Optional[str]]] = None) -> str:
    """docs/compatibility-thirdparty.md: one row per optimizer and preset (one row for a skipped optimizer),
    then a recommendation per optimizer and the package versions."""
    out = [header.rstrip(), "", "| optimizer | preset | works | state bits/param | held-out loss (unwrapped) | "
           "gap per seed | fp32 exact | verdict |", "|---|---|---|---:|---|---|---|---|"]
    for name, entry in table.items():
        if entry["skip"] is not None:
            out.append(f"| {name} | | skipped: {one_line(entry['skip'])} | | | | | skipped |")
            continue
        base = statistics.fmean(entry["base"])
        for row in entry["rows"]:
            if row.reason is not None:
                out.append(f"| {name} | `{row.preset}` | no: {one_line(row.reason)} | | | | | refused |")
                continue
            gaps = ", ".join(f"{g:+.2f}%" for g in row.gaps)
            exact = "" if row.exact is None else "exact" if row.exact else "differs"
            out.append(f"| {name} | `{row.preset}` | yes | {row.bits_per_param:.1f} | {row.loss:.4f} ({base:.4f}) | "
                       f"{gaps} | {exact} | {row.verdict} |")
    out += ["", "Recommendation per optimizer (smallest state whose every seed stays within "
            f"{HOLDS:g}% of the unwrapped loss), with the settings it ran with:", ""]
    for name, entry in table.items():
        options = ", ".join(f"{k}={v}" for k, v in entry["options"].items()) or "class defaults"
        if entry["skip"] is not None:
            out.append(f"- {name}: skipped ({one_line(entry['skip'])})")
            continue
        text = recommendation(name, entry["rows"])
        if any(r.exact is False for r in entry["rows"]):
            text += "; wrapped `fp32` is not bit-identical to the unwrapped optimizer"
        out.append(f"- {name} ({options}): {text}")
    out += ["", f"Settings: {steps} steps, seeds 0-{seeds - 1}, torch {torch.__version__}; `holds`: every seed within "
            f"{HOLDS:g}% of the unwrapped optimizer's held-out loss, `close`: within {CLOSE:g}%, `degrades`: beyond."]
    if versions:
        out += ["", "Packages: " + ", ".join(f"{dist} {v or 'not installed'}" for dist, v in versions.items()) + "."]
    return "\n".join(out) + "\n"


THIRDPARTY_HEADER = """# Compatibility: third-party optimizers x the presets

> Which optimizers of schedulefree, prodigyopt, lion-pytorch, came-pytorch, torch-optimi, heavyball,
> adam-mini and pytorch-optimizer can I wrap, with which preset, and how close do they stay to the
> unwrapped optimizer?

Made by `optstate compat --thirdparty` (`optstate_core/apps/compat.py` says what the task is; the
discovery, the settings per optimizer and the reasons to skip one are in
`optstate_core/apps/thirdparty.py`); rerun it after a change to a codec or a preset, or after
upgrading a package. Every optimizer class these packages export (for pytorch-optimizer: every name
of `get_supported_optimizers()`) is listed. Each runs the same MLP regression as
docs/compatibility.md, unwrapped and wrapped with each preset, from the same initial weights on the
same batches. An optimizer is `skipped` when it cannot run this task with a plain `step()` (it needs
a closure, `create_graph=True`, the model itself, a process group...), when it is `torch.optim`'s
own class, or when unwrapped it does not train the task with the settings given (a seed's held-out
loss stays above 80% of the initial one, or is not finite). Schedule-free optimizers are switched
with `train()` before the steps and `eval()` before the held-out loss (through the wrapper when
wrapped).
heavyball runs eager (its `torch.compile` is turned off). The task seeds torch's and numpy's global
random streams, so an optimizer that draws from them (pytorch-optimizer's Kron uses numpy's)
repeats itself. `fp32 exact`: whether the wrapped `fp32`
run ends with weights `torch.equal` to the unwrapped run's on every seed (`differs`: it does not).
State bits/param count what `memory_report()` counts on this small model (tensors under 4096
elements stay fp32)."""


HEADER = """# Compatibility: every torch optimizer x the presets

> Which `torch.optim` optimizers can I wrap, with which preset, and how close do they stay to the
> unwrapped optimizer?

Made by `optstate compat` (`optstate_core/apps/compat.py`, which also says what the task is); rerun
it after a change to a codec or a preset. State bits/param count what `memory_report()` counts on
this small model, where tensors under 4096 elements (biases) stay fp32, so they sit above the
figures of a large model. Adafactor keeps its factored row and column statistics as they are (fp32,
beside the parameter, in every preset, `offload` included): only its 1-D `variance` of tensors of
4096 elements or more is compressed. Muon takes 2-D parameters only: its model has no biases. The
presets pick a codec per optimizer where one needs it (`optimizer_codecs` in `presets.py`): SGD's
momentum rounds stochastically at 4 bits, Muon's momentum stays int8 with nearest rounding in
every compressed preset (4 bits or stochastic rounding do not hold its loss)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=200, help="training steps per run (default: %(default)s)")
    p.add_argument("--seeds", type=int, default=3, help="seeds per optimizer and preset (default: %(default)s)")
    p.add_argument("--optimizers", default=None,
                   help="comma-separated torch.optim class names (default: every one this torch has); with "
                        "--thirdparty, package:Class names such as schedulefree:AdamWScheduleFree or "
                        "pytorch_optimizer:Lamb (default: every one discovered)")
    p.add_argument("--presets", default=None,
                   help=f"comma-separated (default: {','.join(PRESETS_COMPARED)}; with --thirdparty: "
                        f"{','.join(THIRDPARTY_PRESETS)})")
    p.add_argument("--thirdparty", action="store_true",
                   help="the optimizers of schedulefree, prodigyopt, lion-pytorch, came-pytorch, torch-optimi, "
                        "heavyball, adam-mini and pytorch-optimizer that are installed, in place of torch.optim "
                        "(e.g. --out docs/compatibility-thirdparty.md)")
    p.add_argument("--jobs", type=int, default=1,
                   help="with --thirdparty: processes, one optimizer per task (default: %(default)s)")
    p.add_argument("--out", default=None, help="write the markdown table here (e.g. docs/compatibility.md)")


def run(args) -> int:
    if args.steps < 1 or args.seeds < 1:
        raise ValueError(f"--steps and --seeds must be at least 1, got {args.steps} and {args.seeds}")
    if getattr(args, "jobs", 1) < 1:
        raise ValueError(f"--jobs must be at least 1, got {args.jobs}")
    thirdparty = getattr(args, "thirdparty", False)
    names = None if args.optimizers is None else [n.strip() for n in args.optimizers.split(",") if n.strip()]
    if not thirdparty:
        if names is None:
            names = torch_optimizers()
        elif any(":" in n for n in names):
            raise ValueError("--optimizers: package:Class names are third-party optimizers: add --thirdparty")
        unknown = [n for n in names if n not in SETTINGS or not hasattr(torch.optim, n)]
        if unknown:
            raise ValueError(f"--optimizers: {', '.join(unknown)} not in torch.optim or without settings here "
                             f"(known: {', '.join(sorted(SETTINGS))})")
    default_presets = THIRDPARTY_PRESETS if thirdparty else PRESETS_COMPARED
    presets = [p.strip() for p in (args.presets or ",".join(default_presets)).split(",")]
    from ..presets import PRESET_ALIASES, PRESETS
    bad = [p for p in presets if PRESET_ALIASES.get(p, p) not in PRESETS]
    if bad:
        raise ValueError(f"--presets: unknown {', '.join(bad)}")
    from tqdm import tqdm
    torch.set_num_threads(1)
    logging.getLogger("optstate").setLevel(logging.WARNING)  # not one line per wrapped run
    log.setLevel(logging.INFO)
    if thirdparty:
        from . import thirdparty as tp
        with tqdm(total=len(tp.discover(names, probe=False)) * len(presets), desc="optstate compat --thirdparty") as bar:
            def partial(table):  # what is done so far, in case the run is stopped
                if args.out:
                    Path(args.out).write_text(thirdparty_markdown(table, args.seeds, args.steps, THIRDPARTY_HEADER,
                                                                  tp.versions()))
            if args.jobs > 1:
                table = thirdparty_rows_parallel([e.name for e in tp.discover(names, probe=False)], presets,
                                                 args.seeds, args.steps, args.jobs, progress=bar, on_result=partial)
            else:
                table = thirdparty_rows(tp.discover(names), presets, args.seeds, args.steps, progress=bar)
        text = thirdparty_markdown(table, args.seeds, args.steps, THIRDPARTY_HEADER, tp.versions())
    else:
        with tqdm(total=len(names) * len(presets), desc="optstate compat") as bar:
            table = compat_rows(names, presets, args.seeds, args.steps, progress=bar)
        text = to_markdown(table, args.seeds, args.steps, HEADER)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
        log.info("wrote %s", args.out)
    return 0
