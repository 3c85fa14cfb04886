"""``optstate demo``: a small byte-level language model trained with AdamW and with optstate presets.

Everything is built here, with nothing to download: the model is a small causal transformer
built from a :class:`DemoConfig` (vocabulary = the 256 byte values, so no tokenizer), and the
text is real Python source read at run time (by default the standard library's own ``.py``
files), split into training and held-out text *by file*. Every run uses the same initial
weights, the same batches in the same order and the same held-out windows, so the runs differ
only in the optimizer. Outputs: ``metrics.csv`` (one row per step and run), ``demo.png``
(loss curves and optimizer-state memory per run) and a summary table.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import logging
import math
import os
import statistics
import time
from pathlib import Path
from typing import List, Optional, Sequence

import torch
import torch.nn as nn

# the demo's parts, re-exported: tests and scripts reach them as demo.<name>
from .corpus import Corpus, default_text_dir, is_held_out, load_corpus, train_offsets, val_offsets, windows
from .demo_config import DemoConfig, RunResult
from .report import CSV_COLUMNS, format_summary, gap_percent, plot, summary_rows, write_csv
from .tinylm import Block, TinyLM

__all__ = ["Block", "CSV_COLUMNS", "Corpus", "DemoConfig", "RunResult", "TinyLM", "default_text_dir", "format_summary",
           "gap_percent", "is_held_out", "load_corpus", "plot", "summary_rows", "train_offsets", "val_offsets",
           "windows", "write_csv", "train_run", "train_all", "parse_presets", "config_from_args", "run"]

log = logging.getLogger("optstate.demo")

ADAMW = "adamw"


# -- one run --------------------------------------------------------------------------------
def run_name(preset: Optional[str]) -> str:
    return ADAMW if preset is None else f"optstate-{preset}"


def split_release(preset: Optional[str]):
    """``"bf16w-4bit-lean+release"`` -> ``("bf16w-4bit-lean", True)``; a plain preset -> ``(preset, False)``."""
    if preset is not None and preset.endswith("+release"):
        return preset[:-len("+release")], True
    return preset, False


def build_optimizer(model: nn.Module, cfg: DemoConfig, preset: Optional[str]) -> torch.optim.Optimizer:
    """AdamW (weight decay on matrices only), wrapped with ``preset`` unless it is None; a
    ``+release`` preset updates in backward and clips itself (``cfg.clip_mode`` at ``cfg.clip``)."""
    from ..presets import wrap
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    inner = torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95))
    if preset is None:
        return inner
    preset, release = split_release(preset)
    options = dict(release_gradients=True, max_grad_norm=cfg.clip or None, clip_mode=cfg.clip_mode) if release else {}
    if release and cfg.release_bucket_bytes is not None:
        options["release_bucket_bytes"] = cfg.release_bucket_bytes
    return wrap(inner, preset, named_parameters=model.named_parameters(), **options)


def lr_lambda(cfg: DemoConfig):
    """Linear warmup, then cosine decay to 10% of the peak."""
    def fn(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return fn


def plain_state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of a torch optimizer's state tensors (step counters excluded, as memory_report does)."""
    return sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
               if isinstance(v, torch.Tensor) and v.dim() > 0 and v.is_floating_point())


def cpu_rss_bytes() -> int:
    """This process's resident memory (Linux: /proc/self/statm; elsewhere the peak from resource)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if os.uname().sysname == "Darwin" else peak * 1024


@torch.no_grad()
def evaluate(model: nn.Module, text: torch.Tensor, offsets: torch.Tensor, cfg: DemoConfig) -> float:
    model.eval()
    device = next(model.parameters()).device
    total = sum(model.loss(windows(text, row, cfg.seq_len).to(device)).item() for row in offsets)
    model.train()
    return total / len(offsets)


def train_run(preset: Optional[str], cfg: DemoConfig, corpus: Corpus, progress: bool = True,
              init_state: Optional[dict] = None, keep_state: bool = False) -> RunResult:
    """Train one model from the config's seed with AdamW (``preset=None``) or an optstate preset.
    ``init_state``: fp32 weights (a state_dict) to start from instead of the seed's random ones (a
    fine-tuning run; the seed still picks the batch order); ``keep_state``: return the trained
    weights in ``RunResult.final_state``."""
    from ..metrics import bits_per_param
    device = torch.device(cfg.device)
    name = run_name(preset)
    torch.manual_seed(cfg.seed)
    model = TinyLM.from_config(cfg)
    if init_state is not None:
        model.load_state_dict(init_state)
    model = model.to(device)
    n_params = sum(p.numel() for p in model.parameters())
    from ..presets import has_master_weights
    base, release = split_release(preset)
    if has_master_weights(base):  # bf16 parameters; the optimizer keeps the fp32 masters
        from ..state.master_weights import cast_model
        cast_model(model)
    opt = build_optimizer(model, cfg, preset)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg))
    train_idx, val_idx = train_offsets(corpus, cfg), val_offsets(corpus, cfg)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    bar = progress_bar(cfg.steps, name, progress)
    rows, times = [], []
    for step in range(cfg.steps):
        batch = windows(corpus.train, train_idx[step], cfg.seq_len).to(device, non_blocking=True)
        if cuda:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        loss = model.loss(batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if cfg.clip and not release:  # released gradients are gone: the optimizer clipped them
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)
        if cuda:  # so that AdamW's step time does not include the tail of backward
            torch.cuda.synchronize(device)
        t_opt = time.perf_counter()
        opt.step()
        loss_value = loss.item()  # synchronizes on CUDA
        if cuda:
            torch.cuda.synchronize(device)
        t1 = time.perf_counter()
        sched.step()
        if not math.isfinite(loss_value):
            log.warning("%s: non-finite training loss at step %d", name, step + 1)
        val = evaluate(model, corpus.val, val_idx, cfg) if (step + 1) % cfg.eval_every == 0 or \
            step + 1 == cfg.steps else None
        times.append((t1 - t0) * 1e3)
        rows.append(_row(name, step + 1, loss_value, val, times[-1], (t1 - t_opt) * 1e3, opt, device))
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{loss_value:.3f}", **({"val": f"{val:.3f}"} if val is not None else {}))
    if bar is not None:
        bar.close()
    state = plain_state_bytes(opt) if preset is None else opt.memory_report()["state_bytes"]
    final_state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()} if keep_state else None
    result = RunResult(name, preset, rows, n_params, state, bits_per_param(state, n_params),
                       statistics.median(times[min(3, len(times) - 1):]), rows[-1]["val_loss"], final_state)
    del model, opt, sched
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return result


def _row(name, step, loss, val, step_ms, opt_ms, opt, device) -> dict:
    if hasattr(opt, "memory_report"):
        report = opt.memory_report()
        last = report["last_step"]
        state, active = report["state_bytes"], bool(report["compression_active"])
        phases = (last["materialize_ms"], last["inner_step_ms"], last["commit_ms"],
                  max(0.0, last["total_ms"] - last["inner_step_ms"]))
    else:  # plain AdamW: its whole step is the "inner step"; there is nothing around it
        state, active = plain_state_bytes(opt), False
        phases = (0.0, opt_ms, 0.0, 0.0)
    cuda = device.type == "cuda"
    return {
        "run": name, "step": step, "loss": loss, "val_loss": val, "step_time_ms": step_ms,
        "tensor_mem_mb": state / 2**20, "materialize_ms": phases[0], "inner_step_ms": phases[1],
        "commit_ms": phases[2], "overhead_ms": phases[3], "cpu_mem_mb": cpu_rss_bytes() / 2**20,
        "gpu_mem_mb": torch.cuda.memory_allocated(device) / 2**20 if cuda else 0.0,
        "gpu_peak_mb": torch.cuda.max_memory_allocated(device) / 2**20 if cuda else 0.0,
        "compression_active": active,
    }


def progress_bar(total: int, desc: str, enabled: bool):
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=f"{desc:>16}", unit="step", leave=True, dynamic_ncols=True)


def train_all(cfg: DemoConfig, presets: Sequence[str], corpus: Optional[Corpus] = None,
              progress: bool = True) -> List[RunResult]:
    """AdamW, then each preset, with the same seed, initial weights and data order."""
    cfg.validate()
    corpus = corpus or load_corpus(cfg.data, cfg.max_bytes)
    return [train_run(p, cfg, corpus, progress) for p in [None, *presets]]


def parse_presets(text: str) -> List[str]:
    """``"8bit,4bit"`` -> names checked against :data:`optstate_core.PRESETS` (each may end in
    ``+release``: gradient release, clipping by ``--clip-mode``)."""
    from ..presets import PRESET_ALIASES, PRESETS
    names = [t.strip() for t in text.split(",") if t.strip()]
    for n in names:
        base, _ = split_release(n)
        if base not in PRESETS and base not in PRESET_ALIASES:
            raise ValueError(f"--presets: unknown preset {n!r}; valid: {', '.join(sorted(PRESETS))} "
                             "(each with an optional +release)")
    if len(set(names)) != len(names):
        raise ValueError(f"--presets: a preset is named twice in {text!r}")
    return names


def add_training_arguments(parser: argparse.ArgumentParser, skip: Sequence[str] = ()) -> None:
    """The options of one training run (shared by ``demo`` and ``bench --convergence``)."""
    d = DemoConfig()
    opts = [
        ("--presets", dict(default="8bit,4bit", help="comma-separated optstate presets to compare with AdamW "
                           "(from: default, 8bit, 4bit, bf16, fp32, offload; default: %(default)s)")),
        ("--steps", dict(type=int, default=d.steps, help="training steps per run (default: %(default)s)")),
        ("--batch-size", dict(type=int, default=d.batch_size, help="sequences per batch (default: %(default)s)")),
        ("--seq-len", dict(type=int, default=d.seq_len, help="bytes per sequence (default: %(default)s)")),
        ("--d-model", dict(type=int, default=d.d_model, help="model width (default: %(default)s)")),
        ("--n-layers", dict(type=int, default=d.n_layers, help="transformer blocks (default: %(default)s)")),
        ("--n-heads", dict(type=int, default=d.n_heads, help="attention heads (default: %(default)s)")),
        ("--lr", dict(type=float, default=d.lr, help="peak learning rate; linear warmup, then cosine decay to "
                      "10%% (default: %(default)s)")),
        ("--weight-decay", dict(type=float, default=d.weight_decay,
                                help="AdamW weight decay on weight matrices (default: %(default)s)")),
        ("--clip", dict(type=float, default=d.clip, help="gradient-norm clipping: global, or by --clip-mode "
                        "for +release presets; 0: off (default: %(default)s)")),
        ("--clip-mode", dict(default=d.clip_mode, help="how +release presets clip: auto (the exact global norm "
                             "when one batch holds the step, else per tensor), previous (else the previous step's "
                             "global norm) or per_tensor (default: %(default)s)")),
        ("--release-bucket-bytes", dict(type=_bucket_bytes, default=None,
                                        help="+release presets: gradient bytes pending before one batched update; 0 "
                                             "updates each gradient in its hook, so 'previous' clips one step late "
                                             "(default: the optimizer's, 256MiB)")),
        ("--warmup-steps", dict(type=int, default=d.warmup_steps, help="LR warmup steps (default: %(default)s)")),
        ("--eval-every", dict(type=int, default=d.eval_every,
                              help="held-out loss every N steps and at the end (default: %(default)s)")),
        ("--eval-batches", dict(type=int, default=d.eval_batches,
                                help="held-out batches per evaluation (default: %(default)s)")),
        ("--seed", dict(type=int, default=d.seed, help="seed of the initial weights and the batch order, "
                        "shared by all runs (default: %(default)s)")),
        ("--device", dict(default=None, help="cuda or cpu (default: cuda if available, else cpu)")),
        ("--data", dict(default=None, help="a directory of .py files (or one text file) to train on "
                        "(default: the Python standard library's sources)")),
        ("--max-bytes", dict(type=int, default=d.max_bytes,
                             help="at most this many bytes of training text (default: %(default)s)")),
        ("--no-progress", dict(action="store_true", help="no progress bars")),
    ]
    for flag, kwargs in opts:
        if flag.lstrip("-").replace("-", "_") not in skip:
            parser.add_argument(flag, **kwargs)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_training_arguments(parser)
    parser.add_argument("--out", default=None,
                        help="output directory for metrics.csv and demo.png (default: runs/demo-<time>)")
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG figure")


def _bucket_bytes(text: str) -> int:
    from ..state.units import parse_bytes
    try:
        return parse_bytes(text, "--release-bucket-bytes", allow_zero=True)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def config_from_args(args) -> DemoConfig:
    fields = {f.name for f in dataclasses.fields(DemoConfig)}
    values = {k: v for k, v in vars(args).items() if k in fields and v is not None}
    values["device"] = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if values["device"] not in ("cpu", "cuda") and not values["device"].startswith("cuda:"):
        raise ValueError(f"--device must be cpu or cuda, got {values['device']!r}")
    if values["device"].startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available")
    return DemoConfig(**values).validate()


def describe(cfg: DemoConfig, n_params: Optional[int] = None) -> str:
    size = f"{n_params / 1e6:.2f}M params, " if n_params else ""
    return (f"byte-level LM: {size}d_model {cfg.d_model}, {cfg.n_layers} layers, {cfg.n_heads} heads; "
            f"{cfg.steps} steps of {cfg.batch_size}x{cfg.seq_len} bytes; device {_device_name(cfg.device)}")


def _device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return f"cpu ({torch.get_num_threads()} threads)"


def run(args) -> int:
    """``optstate demo``: train, write metrics.csv and demo.png, print the summary."""
    cfg = config_from_args(args)
    presets = parse_presets(args.presets)
    out = Path(args.out or Path("runs") / time.strftime("demo-%Y%m%d-%H%M%S"))
    out.mkdir(parents=True, exist_ok=True)
    print(describe(cfg), flush=True)
    corpus = load_corpus(cfg.data, cfg.max_bytes)
    results = train_all(cfg, presets, corpus, progress=not args.no_progress)
    write_csv(results, out / "metrics.csv")
    title = describe(cfg, results[0].n_params)
    plotted = False
    if not args.no_plot:
        try:
            plot(results, out / "demo.png", title)
            plotted = True
        except ImportError as e:  # matplotlib is an optional dependency (the "demo" extra)
            log.warning("no figure: %s (pip install 'optstate[demo]')", e)
    summary = format_summary(results)
    (out / "summary.md").write_text(f"{title}\n\n{summary}\n")
    print(f"\n{title}\n{summary}")
    print("state MB / bits/param: optimizer state held between steps; x AdamW: median training step time "
          "(forward + backward + step) over AdamW's; gap: final held-out loss vs AdamW's.")
    print(f"\nwrote {out / 'metrics.csv'}" + (f" and {out / 'demo.png'}" if plotted else ""))
    return 0
