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
import csv
import dataclasses
import gc
import logging
import math
import os
import statistics
import sysconfig
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

log = logging.getLogger("optstate.demo")

#: metrics.csv columns, in order
CSV_COLUMNS = ("run", "step", "loss", "val_loss", "step_time_ms", "tensor_mem_mb", "materialize_ms",
               "inner_step_ms", "commit_ms", "overhead_ms", "cpu_mem_mb", "gpu_mem_mb", "gpu_peak_mb",
               "compression_active")
ADAMW = "adamw"
TEXT_SUFFIXES = (".py",)
HOLDOUT_EVERY = 10  # about one file in ten is held out (chosen by a hash of its name)


@dataclass
class DemoConfig:
    """One training run's settings; the defaults finish the demo in ~2 minutes on 2 CPU cores."""

    steps: int = 200
    batch_size: int = 16
    seq_len: int = 128
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    lr: float = 3e-3
    weight_decay: float = 0.1
    warmup_steps: int = 20
    eval_every: int = 25
    eval_batches: int = 8
    seed: int = 0
    device: str = "cpu"
    data: Optional[str] = None
    max_bytes: int = 4_000_000

    def validate(self) -> "DemoConfig":
        for name in ("steps", "batch_size", "seq_len", "d_model", "n_layers", "n_heads", "eval_every",
                     "eval_batches", "max_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be an integer >= 1, got {value!r}")
        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ValueError(f"--warmup-steps must be an integer >= 0, got {self.warmup_steps!r}")
        if self.d_model % self.n_heads:
            raise ValueError(f"--d-model ({self.d_model}) must be a multiple of --n-heads ({self.n_heads})")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"--lr must be a positive number, got {self.lr!r}")
        if not (self.weight_decay >= 0 and math.isfinite(self.weight_decay)):
            raise ValueError(f"--weight-decay must be a number >= 0, got {self.weight_decay!r}")
        return self


# -- data -----------------------------------------------------------------------------------
@dataclass
class Corpus:
    train: torch.Tensor  # uint8 bytes
    val: torch.Tensor
    source: str
    n_train_files: int
    n_val_files: int


def default_text_dir() -> Path:
    """The standard library's source directory (where ``os.py`` lives)."""
    return Path(sysconfig.get_paths()["stdlib"])


def _text_files(root: Path) -> List[Path]:
    if root.is_file():
        return [root]
    if not root.is_dir():
        raise ValueError(f"--data: {str(root)!r} is neither a file nor a directory")
    return sorted(p for p in root.glob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)


def is_held_out(path: Path) -> bool:
    """Held-out files are chosen by a hash of the file name: stable across machines and versions."""
    return zlib.crc32(path.name.encode()) % HOLDOUT_EVERY == 0


def load_corpus(data: Optional[str] = None, max_bytes: int = 4_000_000) -> Corpus:
    """Training and held-out bytes from the ``.py`` files of ``data`` (a directory or one file;
    default: the standard library, else torch's own sources). The held-out text is whole files,
    capped at ``max_bytes // 10``; training text is capped at ``max_bytes``."""
    if data is not None:
        roots = [Path(data)]
    else:  # some Python builds ship the standard library zipped: then read torch's sources
        roots = [default_text_dir(), Path(torch.__file__).parent]
    files: List[Path] = []
    for root in roots:
        files = _text_files(root)
        if files:
            break
    if not files:
        raise ValueError(f"--data: no {'/'.join(TEXT_SUFFIXES)} files found in {', '.join(map(str, roots))}")
    val_files = [f for f in files if is_held_out(f)]
    train_files = [f for f in files if not is_held_out(f)]
    if len(files) == 1:  # one file: its last tenth is the held-out text
        raw = files[0].read_bytes()
        cut = len(raw) - len(raw) // HOLDOUT_EVERY
        train, val = raw[:cut][:max_bytes], raw[cut:][:max(1, max_bytes // HOLDOUT_EVERY)]
        n_train, n_val = 1, 1
    else:
        if not val_files:
            val_files, train_files = train_files[-1:], train_files[:-1]
        if not train_files:
            train_files, val_files = val_files[:-1], val_files[-1:]
        train, n_train = _read_capped(train_files, max_bytes)
        val, n_val = _read_capped(val_files, max(1, max_bytes // HOLDOUT_EVERY))
    corpus = Corpus(torch.frombuffer(bytearray(train), dtype=torch.uint8),
                    torch.frombuffer(bytearray(val), dtype=torch.uint8),
                    str(files[0].parent if len(files) > 1 else files[0]), n_train, n_val)
    log.info("text: %s (%d train files, %.2f MB; %d held-out files, %.2f MB)", corpus.source, n_train,
             len(train) / 1e6, n_val, len(val) / 1e6)
    return corpus


def _read_capped(files: Sequence[Path], cap: int) -> Tuple[bytes, int]:
    parts, total, used = [], 0, 0
    for f in files:
        if total >= cap:
            break
        raw = f.read_bytes()
        parts.append(raw[:cap - total])
        total += len(parts[-1])
        used += 1
    return b"".join(parts), used


def train_offsets(corpus: Corpus, cfg: DemoConfig) -> torch.Tensor:
    """Start offsets of every training window, ``[steps, batch]``: a function of the seed only."""
    high = len(corpus.train) - cfg.seq_len - 1
    if high < 1:
        raise ValueError(f"--seq-len {cfg.seq_len} is longer than the training text ({len(corpus.train)} bytes)")
    g = torch.Generator().manual_seed(cfg.seed + 1)
    return torch.randint(0, high, (cfg.steps, cfg.batch_size), generator=g)


def val_offsets(corpus: Corpus, cfg: DemoConfig) -> torch.Tensor:
    """Evenly spaced held-out windows, ``[eval_batches, batch]`` (the same for every seed)."""
    high = len(corpus.val) - cfg.seq_len - 1
    if high < 1:
        raise ValueError(f"--seq-len {cfg.seq_len} is longer than the held-out text ({len(corpus.val)} bytes)")
    n = cfg.eval_batches * cfg.batch_size
    return torch.linspace(0, high, n).long().view(cfg.eval_batches, cfg.batch_size)


def windows(text: torch.Tensor, offsets: torch.Tensor, seq_len: int) -> torch.Tensor:
    """``[len(offsets), seq_len + 1]`` int64 byte windows."""
    idx = offsets.view(-1, 1) + torch.arange(seq_len + 1)
    return text[idx].long()


# -- model ----------------------------------------------------------------------------------
class Block(nn.Module):
    """Pre-LayerNorm transformer block: causal self-attention, then a 4x GELU MLP."""

    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.n_heads = n_heads
        self.ln_attn = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln_mlp = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.out = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln_attn(x)).view(b, t, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln_mlp(x))))


class TinyLM(nn.Module):
    """Byte-level causal LM: token + learned position embeddings, blocks, tied output layer."""

    vocab_size = 256

    def __init__(self, d_model: int, n_layers: int, n_heads: int, max_len: int):
        super().__init__()
        self.embed = nn.Embedding(self.vocab_size, d_model)
        self.pos = nn.Embedding(max_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads) for _ in range(n_layers))
        self.ln_out = nn.LayerNorm(d_model)
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * n_layers) if name.endswith(("proj.weight", "out.weight"))
                                else 0.02)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    @classmethod
    def from_config(cls, cfg: DemoConfig) -> "TinyLM":
        return cls(cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.seq_len)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.embed(idx) + self.pos.weight[: idx.shape[1]]
        for block in self.blocks:
            h = block(h)
        return F.linear(self.ln_out(h), self.embed.weight)

    def loss(self, batch: torch.Tensor) -> torch.Tensor:
        logits = self(batch[:, :-1])
        return F.cross_entropy(logits.reshape(-1, self.vocab_size), batch[:, 1:].reshape(-1))


# -- one run --------------------------------------------------------------------------------
def run_name(preset: Optional[str]) -> str:
    return ADAMW if preset is None else f"optstate-{preset}"


def build_optimizer(model: nn.Module, cfg: DemoConfig, preset: Optional[str]) -> torch.optim.Optimizer:
    """AdamW (weight decay on matrices only), wrapped with ``preset`` unless it is None."""
    from .presets import wrap
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    inner = torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95))
    if preset is None:
        return inner
    return wrap(inner, preset, named_parameters=model.named_parameters())


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


@dataclass
class RunResult:
    name: str
    preset: Optional[str]
    rows: List[dict]
    n_params: int
    state_bytes: int
    bits_per_param: float
    step_ms: float  # median training step (forward + backward + optimizer step)
    final_val_loss: float


def train_run(preset: Optional[str], cfg: DemoConfig, corpus: Corpus, progress: bool = True) -> RunResult:
    """Train one model from the config's seed with AdamW (``preset=None``) or an optstate preset."""
    from .metrics import bits_per_param
    device = torch.device(cfg.device)
    name = run_name(preset)
    torch.manual_seed(cfg.seed)
    model = TinyLM.from_config(cfg).to(device)
    n_params = sum(p.numel() for p in model.parameters())
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
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
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
    result = RunResult(name, preset, rows, n_params, state, bits_per_param(state, n_params),
                       statistics.median(times[min(3, len(times) - 1):]), rows[-1]["val_loss"])
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


# -- outputs --------------------------------------------------------------------------------
def write_csv(results: Sequence[RunResult], path: Path) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        for r in results:
            for row in r.rows:
                writer.writerow({k: _csv_value(row[k]) for k in CSV_COLUMNS})


def _csv_value(v):
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.6g}"
    return v


def gap_percent(value: float, reference: float) -> float:
    """Relative difference to the reference, in percent."""
    return 100.0 * (value - reference) / reference


def summary_rows(results: Sequence[RunResult]) -> List[dict]:
    ref = next(r for r in results if r.preset is None)
    return [{"run": r.name, "state_mb": r.state_bytes / 2**20, "bits_per_param": r.bits_per_param,
             "step_ms": r.step_ms, "time_ratio": r.step_ms / ref.step_ms, "val_loss": r.final_val_loss,
             "gap_pct": gap_percent(r.final_val_loss, ref.final_val_loss)} for r in results]


def format_summary(results: Sequence[RunResult]) -> str:
    lines = ["| run | state MB | bits/param | step ms | x AdamW | final val loss | gap to AdamW |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for s in summary_rows(results):
        lines.append(f"| {s['run']} | {s['state_mb']:.2f} | {s['bits_per_param']:.1f} | {s['step_ms']:.1f} | "
                     f"{s['time_ratio']:.2f} | {s['val_loss']:.4f} | {s['gap_pct']:+.2f}% |")
    return "\n".join(lines)


def plot(results: Sequence[RunResult], path: Path, title: str = "") -> None:
    """Loss curves (train, smoothed, and held-out) beside optimizer-state memory per run."""
    import matplotlib
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_mem) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [3, 2]})
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    summary = summary_rows(results)
    for i, r in enumerate(results):
        c = colors[i % len(colors)]
        steps = [row["step"] for row in r.rows]
        ax_loss.plot(steps, _smooth([row["loss"] for row in r.rows]), color=c, alpha=0.6, lw=1,
                     label=f"{r.name} train")
        val = [(row["step"], row["val_loss"]) for row in r.rows if row["val_loss"] is not None]
        if val:
            ax_loss.plot(*zip(*val), color=c, marker="o", ls="--", label=f"{r.name} held-out")
    vals = [row["val_loss"] for r in results for row in r.rows if row["val_loss"] is not None]
    if vals:  # the first steps' large losses would flatten the part worth seeing
        ax_loss.set_ylim(top=max(vals) + 0.5 * (max(vals) - min(vals)) + 0.05)
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("loss (nats / byte)")
    ax_loss.set_title("loss")
    ax_loss.legend(fontsize=8)
    ax_loss.grid(alpha=0.3)
    names = [s["run"] for s in summary]
    bars = ax_mem.bar(names, [s["state_mb"] for s in summary], color=colors[:len(names)])
    for bar, s in zip(bars, summary):
        ax_mem.annotate(f"{s['bits_per_param']:.1f} bits/param\n{s['time_ratio']:.2f}x step time",
                        (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=8)
    ax_mem.set_ylabel("optimizer state (MiB)")
    ax_mem.set_title("optimizer-state memory")
    ax_mem.margins(y=0.25)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _smooth(values: Sequence[float]) -> List[float]:
    """Centered moving average (no lag) over about 1/40 of the run."""
    half = len(values) // 80
    out = []
    for i in range(len(values)):
        window = values[max(0, i - half): i + half + 1]
        out.append(sum(window) / len(window))
    return out


# -- command line ---------------------------------------------------------------------------
def parse_presets(text: str) -> List[str]:
    """``"8bit,4bit"`` -> names checked against :data:`optstate_core.PRESETS`."""
    from .presets import PRESET_ALIASES, PRESETS
    names = [t.strip() for t in text.split(",") if t.strip()]
    for n in names:
        if n not in PRESETS and n not in PRESET_ALIASES:
            raise ValueError(f"--presets: unknown preset {n!r}; valid: {', '.join(sorted(PRESETS))}")
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
