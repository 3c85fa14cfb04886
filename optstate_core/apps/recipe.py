"""``optstate plan``'s recipe: how to fine-tune a model on one card, as examples/finetune_8b_24gb.py does.

The setup is fixed, whatever the table's flags: AdamW, bf16 weights with the fp32 master kept as
compressed state (the ``bf16w-*`` presets), bf16 gradients released in backward, activation
checkpointing. Of the presets that fit at micro-batch 1 with the fused (chunked) loss,
``bf16w-4bit-lean`` (all state resident), ``bf16w-4bit-lean-hostcorr`` (the master correction in
host memory), ``bf16w-4bit-lean`` with ``gpu_budget`` (resident up to what is left, the rest
streamed) and ``bf16w-4bit-lean-offload`` (all state in host memory), the recipe names the one with
the most tokens/s expected at its largest micro-batch (within 1%: the one that moves fewer bytes over
PCIe per step there, then the earlier in that list). :func:`preset_for` makes the same choice at one
given micro-batch (what examples/finetune_8b_24gb.py runs by default). Then
the micro-batches that fit with the plain loss and with the fused one, what crosses PCIe per step
and the tokens/s to expect against all-resident state.

Tokens/s are estimates: compute time = ``8 * params * tokens`` FLOPs (forward, recomputation,
backward; plus the fused loss's one more ``tokens x hidden x vocab`` matmul) at ``--tflops``; the
optimizer update is ignored. With state in host memory a step takes at least its copy time; the
copies overlap backward at best, so ``max(compute, copy)`` is an upper bound on tokens/s.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional, Sequence, Tuple

from .model_shapes import checkpointed_activation_bytes, config_shapes
from .plan import BUDGET_PRESET, PCIE_BYTES_PER_S, Plan, PlanRow, hints, _how_to_wrap, gib, make_plan

log = logging.getLogger("optstate.plan")

BUDGET = f"{BUDGET_PRESET} + gpu_budget"  # the candidate that keeps state resident up to a budget
#: candidates in order of preference: the least state in host memory first
CANDIDATES = ("bf16w-4bit-lean", "bf16w-4bit-lean-hostcorr", BUDGET, "bf16w-4bit-lean-offload")
PLANNED = tuple(c for c in CANDIDATES if c != BUDGET)  # the presets a plan gets (it adds the budget row)
MICRO_BATCHES = (1, 2, 4, 8, 16, 32)
TIE = 0.01  # expected tokens/s within 1% of each other: the candidate moving fewer bytes over PCIe wins
DEFAULT_SEQ = 2048
#: achieved bf16 TFLOP/s of forward + backward with checkpointing: one H100, Llama-3-8B shapes, batch
#: 1x2048, 0.28 s per forward + backward (= 8 * params * tokens / time)
DEFAULT_TFLOPS = 470.0
EXAMPLE = "examples/finetune_8b_24gb.py"


@dataclass
class MicroBatch:
    """One micro-batch's activations and the chosen preset's row, with the plain and the fused loss."""
    size: int
    activations: Dict[bool, int] = field(default_factory=dict)  # by fused_loss
    rows: Dict[bool, Optional[PlanRow]] = field(default_factory=dict)  # None: the candidate has no row

    def fits(self, fused: bool) -> bool:
        """Whether the chosen preset fits at this micro-batch with the fused (or plain) loss."""
        row = self.rows.get(fused)
        return row is not None and row.fits


@dataclass
class Recipe:
    gpu_memory: int
    seq: int
    tflops: float
    n_params: int
    hidden: int
    vocab: int
    pcie_bytes_per_s: float
    preset: Optional[str]  # one of CANDIDATES, None when nothing fits
    micro_batches: List[MicroBatch]
    first: Plan  # micro-batch 1, fused loss, every candidate
    gpu_text: str = ""

    def largest(self, fused: bool) -> int:
        """The largest micro-batch that fits with the fused (or plain) loss; 0 if none."""
        return max((m.size for m in self.micro_batches if m.fits(fused)), default=0)

    def row(self, size: int, fused: bool = True) -> Optional[PlanRow]:
        """The chosen preset's row at micro-batch ``size``."""
        return next((m.rows.get(fused) for m in self.micro_batches if m.size == size), None)


def check_recipe_args(seq: int, tflops: float) -> None:
    """Reject a non-positive ``--seq`` or ``--tflops``."""
    if isinstance(seq, bool) or not isinstance(seq, int) or seq < 1:
        raise ValueError(f"--seq must be a positive integer (tokens per sequence), got {seq!r}")
    if not tflops > 0:
        raise ValueError(f"--tflops must be a positive number (achieved bf16 TFLOP/s), got {tflops!r}")


def candidate_row(plan: Plan, candidate: str) -> Optional[PlanRow]:
    """The plan's row for ``candidate`` (the gpu_budget row for :data:`BUDGET`), None if it has none."""
    if candidate == BUDGET:
        return next((r for r in plan.rows if r.gpu_budget is not None), None)
    return next((r for r in plan.rows if r.name == candidate), None)


def _plan(shapes, config: dict, gpu_memory: int, size: int, seq: int, fused: bool, presets,
          pcie_bytes_per_s: float) -> Tuple[int, Plan]:
    """The activations of ``size`` x ``seq`` and the plan of ``presets`` with them (the recipe's setup)."""
    activations = checkpointed_activation_bytes(config, size, seq, fused_loss=fused)
    return activations, make_plan(shapes, gpu_memory, "adamw", presets, "bf16", "bf16", activations,
                                  release_gradients=True, pcie_bytes_per_s=pcie_bytes_per_s)


def _presets_of(candidate: str) -> List[str]:
    """The presets make_plan needs for ``candidate``'s row."""
    return [BUDGET_PRESET if candidate == BUDGET else candidate]


def recipe(config: dict, gpu_memory: int, seq: int = DEFAULT_SEQ, tflops: float = DEFAULT_TFLOPS,
           pcie_bytes_per_s: float = PCIE_BYTES_PER_S, gpu_text: str = "") -> Recipe:
    """The one-card recipe for a Llama-family ``config`` on ``gpu_memory`` bytes (see the module doc)."""
    check_recipe_args(seq, tflops)
    shapes = config_shapes(config)
    text = config["text_config"] if "text_config" in config and "hidden_size" not in config else config
    hidden, vocab = int(text["hidden_size"]), int(text["vocab_size"])
    _, first = _plan(shapes, config, gpu_memory, 1, seq, True, PLANNED, pcie_bytes_per_s)
    out = Recipe(gpu_memory, seq, tflops, first.n_params, hidden, vocab, pcie_bytes_per_s, None, [], first,
                 gpu_text or f"{gpu_memory / 1e9:g}GB")
    best, best_key = out, None
    for candidate in CANDIDATES:  # every one that fits at micro-batch 1 with the fused loss
        row = candidate_row(first, candidate)
        if row is None or not row.fits:
            continue
        option = replace(out, preset=candidate,
                         micro_batches=_micro_batches(shapes, config, gpu_memory, seq, candidate, pcie_bytes_per_s))
        size = option.largest(True)
        tps, moved = throughput(option, size)[0], option.row(size).pcie_bytes
        log.debug("recipe: %s, micro-batch %d, %.0f tokens/s, %d bytes over PCIe", candidate, size, tps, moved)
        if best_key is None or tps > best_key[0] * (1 + TIE) or \
                (tps >= best_key[0] / (1 + TIE) and moved < best_key[1]):  # a tie: fewer bytes over PCIe win
            best, best_key = option, (tps, moved)
    return best


def preset_for(config: dict, gpu_memory: int, micro_batch: int, seq: int = DEFAULT_SEQ, fused_loss: bool = True,
               pcie_bytes_per_s: float = PCIE_BYTES_PER_S) -> Tuple[Optional[str], Optional[int]]:
    """``(preset, gpu_budget or None)`` for a Llama-family ``config`` at ``micro_batch`` x ``seq`` on
    ``gpu_memory`` bytes: of :data:`CANDIDATES` that fit, the one that moves the fewest bytes over
    PCIe per step (all-resident state first; then the earlier in that list); ``(None, None)`` when
    none fits."""
    check_recipe_args(seq, DEFAULT_TFLOPS)
    if isinstance(micro_batch, bool) or not isinstance(micro_batch, int) or micro_batch < 1:
        raise ValueError(f"micro_batch must be a positive integer, got {micro_batch!r}")
    _, p = _plan(config_shapes(config), config, gpu_memory, micro_batch, seq, fused_loss, PLANNED,
                 pcie_bytes_per_s)
    row = pick(p)
    if row is None:
        return None, None
    return row.name.split(" + ")[0], row.gpu_budget


def pick(plan: Plan, candidates: Sequence[str] = CANDIDATES) -> Optional[PlanRow]:
    """Of the rows of ``candidates`` in ``plan`` that fit, the one that moves the fewest bytes over
    PCIe per step (all-resident state first), then the earlier in ``candidates``; None when none fits."""
    fitting = [(row.pcie_bytes, i, row) for i, row in enumerate(candidate_row(plan, c) for c in candidates)
               if row is not None and row.fits]
    return min(fitting, key=lambda f: f[:2])[2] if fitting else None


def _micro_batches(shapes, config, gpu_memory, seq, candidate, pcie_bytes_per_s) -> List[MicroBatch]:
    """``candidate``'s rows at micro-batches 1, 2, 4, ... with the plain and the fused loss, up to the
    first where it fits with neither."""
    out = []
    for size in MICRO_BATCHES:
        m = MicroBatch(size)
        for fused in (False, True):
            m.activations[fused], p = _plan(shapes, config, gpu_memory, size, seq, fused, _presets_of(candidate),
                                            pcie_bytes_per_s)
            m.rows[fused] = candidate_row(p, candidate)
        out.append(m)
        if not (m.fits(False) or m.fits(True)):
            break
    return out


def compute_seconds(r: Recipe, size: int, fused: bool = True) -> float:
    """Forward, recomputation and backward of ``size`` sequences at ``r.tflops``."""
    tokens = size * r.seq
    flops = 8 * r.n_params * tokens + (2 * tokens * r.hidden * r.vocab if fused else 0)
    return flops / (r.tflops * 1e12)


def throughput(r: Recipe, size: int, fused: bool = True) -> Tuple[float, float, float, float]:
    """At micro-batch ``size``: (tokens/s, all-resident tokens/s, their ratio, copy seconds per step)."""
    row = r.row(size, fused)
    tokens = size * r.seq
    compute = compute_seconds(r, size, fused)
    copy = row.pcie_bytes / r.pcie_bytes_per_s if row is not None else 0.0
    step = max(compute, copy)
    return tokens / step, tokens / compute, compute / step, copy


def format_recipe(r: Recipe) -> str:
    """The recipe as printed by ``optstate plan``."""
    head = (f"## Recipe: one GPU of {r.gpu_text} ({gib(r.gpu_memory)}), sequences of {r.seq} tokens, as {EXAMPLE}: "
            "AdamW, bf16 weights with fp32 masters as compressed state, bf16 gradients released in backward, "
            "activation checkpointing")
    if r.preset is None:
        return "\n".join([head, "", "nothing fits at micro-batch 1 with the fused (chunked) loss: "
                          + "; ".join(hints(r.first))])
    lines = [head, "", f"preset: {r.preset} (of {', '.join(CANDIDATES)} that fit at micro-batch 1 with the fused "
             "loss, the most tokens/s expected at its largest micro-batch)", "",
             "| micro-batch | activations, plain loss | GPU total | fits | activations, fused loss | GPU total | fits |",
             "|---:|---:|---:|---|---:|---:|---|"]
    for m in r.micro_batches:
        cells = []
        for fused in (False, True):
            row = m.rows[fused]
            total = gib(row.total_gpu) if row is not None else "(no room for a budget)"
            cells += [gib(m.activations[fused]), total, "yes" if m.fits(fused) else "no"]
        lines.append(f"| {m.size} | " + " | ".join(cells) + " |")
    best, plain = r.largest(True), r.largest(False)
    lines += ["", f"largest micro-batch with the fused (chunked) loss: {best}", f"with the plain loss: {plain}"]
    size = best  # >= 1: the preset was chosen at micro-batch 1
    row = r.row(size)
    lines.append(f"wrap: {_how_to_wrap(row, r.first)} (micro-batch {size})")
    moved = row.pcie_bytes
    lines.append(f"PCIe per step, each way: {gib(moved)}, {moved / r.pcie_bytes_per_s:.2f} s at "
                 f"{r.pcie_bytes_per_s / 1e9:g} GB/s (--pcie-gbps)" if moved else
                 "PCIe per step, each way: 0 (all state resident)")
    for s in sorted({best, 1}, reverse=True):
        tps, resident, ratio, copy = throughput(r, s)
        lines.append(f"expected at micro-batch {s}: {tps:,.0f} tokens/s, {ratio:.2f}x the {resident:,.0f} tokens/s "
                     f"of resident state (compute {compute_seconds(r, s):.2f} s, copies {copy:.2f} s per step)")
    lines += [f"tokens/s: 8 x params x tokens (+ the fused loss's extra tokens x hidden x vocab matmul) at "
              f"{r.tflops:g} TFLOP/s (--tflops), the optimizer update ignored; with host state a step takes "
              "max(compute, copies): the copies overlap backward at best, so this is an upper bound.",
              f"run: python {EXAMPLE} --gpu-memory {r.gpu_text} --preset {r.preset.split(' + ')[0]} "
              f"--micro-batch {size}" + (f" --gpu-budget {int(row.gpu_budget / 2**30 * 100) / 100:.2f}GiB" if row.gpu_budget else "")]
    return "\n".join(lines)


def recipe_from_args(args) -> Optional[Recipe]:
    """The recipe ``optstate plan`` prints: for ``--model``, or ``--config`` with ``--recipe``; else None."""
    from ..state.units import parse_bytes
    check_recipe_args(args.seq, args.tflops)
    model, wanted = getattr(args, "model", None), getattr(args, "recipe", False)
    if wanted and not (args.config or model):
        raise ValueError("--recipe needs --model or a Llama-family --config (it estimates activations from the "
                         "model's shapes), not --params")
    if args.gpus > 1:
        if wanted:
            raise ValueError(f"--recipe is for one GPU: leave out --gpus (got --gpus {args.gpus})")
        log.info("(no recipe: it is for one GPU, and --gpus is %d)", args.gpus)
        return None
    if not (model or wanted):
        return None
    if model:
        from .llama import NAMED_SHAPES
        config = NAMED_SHAPES[model].hf_config()
    else:
        from .model_shapes import load_config
        config = load_config(args.config)
    return recipe(config, parse_bytes(args.gpu_memory, "--gpu-memory"), args.seq, args.tflops,
                  args.pcie_gbps * 1e9, str(args.gpu_memory).strip())


def add_arguments(parser) -> None:
    """The recipe's options of ``optstate plan``."""
    parser.add_argument("--recipe", action="store_true",
                        help="after the table, the one-GPU fine-tuning recipe (preset, micro-batches with and "
                             "without the fused loss, PCIe per step, tokens/s) also for --config; always for --model")
    parser.add_argument("--seq", type=int, default=DEFAULT_SEQ,
                        help="the recipe's tokens per sequence (default: %(default)s)")
    parser.add_argument("--tflops", type=float, default=DEFAULT_TFLOPS,
                        help="the recipe's achieved bf16 TFLOP/s of forward + backward with checkpointing "
                             "(default: %(default)s, one H100 on Llama-3-8B shapes at 1x2048)")
