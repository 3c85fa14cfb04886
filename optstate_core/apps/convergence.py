"""``optstate bench --convergence``: does a preset change where training ends up?

Runs the demo's training (:mod:`optstate_core.demo`) for several seeds; each seed changes the
initial weights and the batch order, shared by AdamW and every preset. Reports each preset's
final held-out loss gap to AdamW (paired by seed) next to AdamW's own seed-to-seed spread: a
gap well inside that spread is indistinguishable from re-running AdamW with another seed.
"""
from __future__ import annotations

import csv
import dataclasses
import logging
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Sequence

from . import demo

log = logging.getLogger("optstate.convergence")


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
                    csv_path: Path = None) -> ConvergenceResult:
    cfg.validate()
    if len(seeds) < 2:
        raise ValueError(f"--seeds must be at least 2 (a spread needs two runs), got {len(seeds)}")
    corpus = demo.load_corpus(cfg.data, cfg.max_bytes)
    names = [demo.run_name(p) for p in [None, *presets]]
    losses: Dict[str, List[float]] = {n: [] for n in names}
    bar = demo.progress_bar(len(seeds) * len(names), "convergence", progress)
    for seed in seeds:
        seed_cfg = dataclasses.replace(cfg, seed=seed)
        for preset in [None, *presets]:
            result = demo.train_run(preset, seed_cfg, corpus, progress=False)
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


def run(args) -> int:
    """The ``bench --convergence`` command."""
    if args.seeds < 2:
        raise ValueError(f"--seeds must be at least 2 (a spread needs two runs), got {args.seeds}")
    cfg = demo.config_from_args(args)
    presets = demo.parse_presets(args.presets)
    csv_path = None
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        csv_path = out / "convergence.csv"
    print(demo.describe(cfg), flush=True)
    result = run_convergence(cfg, presets, [args.seed + i for i in range(args.seeds)],
                             progress=not args.no_progress, csv_path=csv_path)
    print("\n" + format_result(result))
    if csv_path is not None:
        print(f"\nwrote {csv_path}")
    return 0
