"""``optstate bench --convergence``: does a preset change where training ends up?

Runs the demo's training (:mod:`optstate_core.demo`) for several seeds; each seed changes the
initial weights and the batch order, shared by AdamW and every preset. Reports each preset's
final held-out loss gap to AdamW (paired by seed) next to AdamW's own seed-to-seed spread: a
gap well inside that spread is indistinguishable from re-running AdamW with another seed.

With ``--finetune`` the runs fine-tune instead: AdamW first trains one model for
``--pretrain-steps`` on the training text (``--data``, default the standard library); every run
then starts from that checkpoint's fp32 weights (``bf16w-*`` presets cast it, keeping the exact
fp32 values as their master weights) and trains on another text (``--finetune-data``, default
torch's own Python sources) at ``--finetune-lr``. The seed then changes only the batch order.
"""
from __future__ import annotations

import csv
import dataclasses
import logging
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch

from . import demo

log = logging.getLogger("optstate.convergence")
PRETRAIN_STEPS = 300  # --finetune: AdamW steps of the checkpoint every run starts from


@dataclass
class ConvergenceRow:
    run: str
    val_losses: List[float]  # final held-out loss per seed
    gaps_pct: List[float]  # per seed, vs AdamW with the same seed

    @property
    def mean_loss(self) -> float:
        return statistics.fmean(self.val_losses)

    @property
    def mean_gap_pct(self) -> float:
        return statistics.fmean(self.gaps_pct)


@dataclass
class ConvergenceResult:
    seeds: List[int]
    rows: List[ConvergenceRow]  # AdamW first

    @property
    def adamw(self) -> ConvergenceRow:
        return self.rows[0]

    def adamw_spread_pct(self) -> Dict[str, float]:
        """AdamW's final held-out loss across seeds: sample std and max - min, as % of the mean."""
        losses = self.adamw.val_losses
        mean = statistics.fmean(losses)
        std = statistics.stdev(losses) if len(losses) > 1 else 0.0
        return {"std": 100 * std / mean, "range": 100 * (max(losses) - min(losses)) / mean}


def run_convergence(cfg: demo.DemoConfig, presets: Sequence[str], seeds: Sequence[int], progress: bool = True,
                    csv_path: Path = None, corpus: Optional[demo.Corpus] = None,
                    init_state: Optional[dict] = None) -> ConvergenceResult:
    """AdamW and each preset for every seed; ``corpus`` (default: the config's text) and
    ``init_state`` (fp32 weights every run starts from; default: the seed's random ones)."""
    cfg.validate()
    if len(seeds) < 2:
        raise ValueError(f"--seeds must be at least 2 (a spread needs two runs), got {len(seeds)}")
    if corpus is None:
        corpus = demo.load_corpus(cfg.data, cfg.max_bytes)
    names = [demo.run_name(p) for p in [None, *presets]]
    losses: Dict[str, List[float]] = {n: [] for n in names}
    bar = demo.progress_bar(len(seeds) * len(names), "convergence", progress)
    for seed in seeds:
        seed_cfg = dataclasses.replace(cfg, seed=seed)
        for preset in [None, *presets]:
            result = demo.train_run(preset, seed_cfg, corpus, progress=False, init_state=init_state)
            losses[result.name].append(result.final_val_loss)
            log.debug("seed %d %s: final held-out loss %.4f", seed, result.name, result.final_val_loss)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(seed=seed, run=result.name)
    if bar is not None:
        bar.close()
    ref = losses[names[0]]
    rows = [ConvergenceRow(n, losses[n], [demo.gap_percent(v, r) for v, r in zip(losses[n], ref)]) for n in names]
    result = ConvergenceResult(list(seeds), rows)
    if csv_path is not None:
        write_csv(result, csv_path)
    return result


def default_finetune_text() -> str:
    """The fine-tuning text by default: torch's own Python sources (another domain than the
    standard library the checkpoint was trained on; ships with every install)."""
    return str(Path(torch.__file__).parent)


def pretrain(cfg: demo.DemoConfig, steps: int, corpus: demo.Corpus, progress: bool = True) -> dict:
    """The checkpoint every fine-tuning run starts from: AdamW for ``steps`` steps (fp32 weights, CPU)."""
    import dataclasses as dc
    result = demo.train_run(None, dc.replace(cfg, steps=steps), corpus, progress=progress, keep_state=True)
    log.info("pretrained checkpoint: %d AdamW steps, held-out loss %.4f", steps, result.final_val_loss)
    return result.final_state


def write_csv(result: ConvergenceResult, path: Path) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["run", "seed", "final_val_loss", "gap_pct"])
        for row in result.rows:
            for seed, loss, gap in zip(result.seeds, row.val_losses, row.gaps_pct):
                w.writerow([row.run, seed, f"{loss:.10g}", f"{gap:.6g}"])


def format_result(result: ConvergenceResult) -> str:
    spread = result.adamw_spread_pct()
    lines = [f"final held-out loss over {len(result.seeds)} seeds ({', '.join(map(str, result.seeds))})",
             f"AdamW's seed-to-seed spread: std {spread['std']:.3f}% of its mean, max - min {spread['range']:.3f}%",
             "",
             "| run | mean final val loss | gap to AdamW (mean) | gap per seed | within AdamW's std? |",
             "|---|---:|---:|---|---|"]
    for row in result.rows:
        per_seed = ", ".join(f"{g:+.2f}%" for g in row.gaps_pct)
        within = "-" if row is result.adamw else ("yes" if abs(row.mean_gap_pct) <= spread["std"] else "no")
        lines.append(f"| {row.run} | {row.mean_loss:.4f} | {row.mean_gap_pct:+.3f}% | {per_seed} | {within} |")
    return "\n".join(lines)


def check_finetune_args(args) -> None:
    """Usage errors of the fine-tuning options (named after their flags)."""
    if not args.finetune:
        for flag in ("pretrain_steps", "finetune_data", "finetune_lr"):
            if getattr(args, flag) is not None:
                raise ValueError(f"--{flag.replace('_', '-')} needs --finetune")
        return
    steps = args.pretrain_steps
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
        raise ValueError(f"--pretrain-steps must be an integer >= 1, got {steps!r}")
    lr = args.finetune_lr
    if lr is not None and not (lr > 0 and lr != float("inf")):
        raise ValueError(f"--finetune-lr must be a positive number, got {lr!r}")


def load_finetune_corpus(args, cfg: demo.DemoConfig) -> demo.Corpus:
    try:
        return demo.load_corpus(args.finetune_data or default_finetune_text(), cfg.max_bytes)
    except ValueError as e:
        raise ValueError(str(e).replace("--data:", "--finetune-data:", 1)) from None


def run(args) -> int:
    """The ``bench --convergence`` command."""
    if args.seeds < 2:
        raise ValueError(f"--seeds must be at least 2 (a spread needs two runs), got {args.seeds}")
    check_finetune_args(args)
    cfg = demo.config_from_args(args)
    presets = demo.parse_presets(args.presets)
    corpus = init_state = None
    if args.finetune:
        tuned = load_finetune_corpus(args, cfg)
        steps = args.pretrain_steps or PRETRAIN_STEPS
        print(f"pretraining the checkpoint: AdamW, {steps} steps on {cfg.data or 'the default text'}", flush=True)
        init_state = pretrain(cfg, steps, demo.load_corpus(cfg.data, cfg.max_bytes), progress=not args.no_progress)
        corpus = tuned
        cfg = dataclasses.replace(cfg, lr=args.finetune_lr or cfg.lr / 10)
        print(f"fine-tuning from it on {tuned.source} at lr {cfg.lr:g}; the seed changes the batch order only",
              flush=True)
    csv_path = None
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        csv_path = out / "convergence.csv"
    print(demo.describe(cfg), flush=True)
    result = run_convergence(cfg, presets, [args.seed + i for i in range(args.seeds)],
                             progress=not args.no_progress, csv_path=csv_path, corpus=corpus, init_state=init_state)
    print("\n" + format_result(result))
    if csv_path is not None:
        print(f"\nwrote {csv_path}")
    return 0
