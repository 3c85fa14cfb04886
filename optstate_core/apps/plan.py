"""``optstate plan``: what fits? Optimizer-state and training memory per preset, without a GPU.

State bytes are computed exactly, the way the optimizer will hold them: for every parameter
shape and state key the preset's policy picks the codec and the tier (as it does at a step
after warmup), and the codec's ``nbytes`` gives the payload size. Shapes come from a Hugging
Face ``config.json`` (Llama / Mistral / Qwen2 / GPT-2 families) or, with only a parameter
count, from an approximation: the parameters as [4096, 4096] matrices (the size of a large
model's layer weights), which ignores that norms and biases stay uncompressed (under 0.1% of a
large model's parameters).

GPU bytes per row: weights + gradients + state kept on the GPU + activations (given) + the
staging ring when state lives in host memory. With ``--release-gradients`` every optstate row
frees gradients in backward, so at most a batch of them is alive (``release_bucket_bytes``, 256
MiB by default, plus the largest parameter's). Rows with state in host memory also say what it
costs: the bytes that cross PCIe each step (each way) and the time that takes at ``--pcie-gbps``,
a floor for the step when nothing hides the copies.

With ``--model`` (or ``--config`` and ``--recipe``) a one-GPU fine-tuning recipe follows the table
(:mod:`optstate_core.apps.recipe`): the preset, the micro-batches that fit with and without the
fused (chunked) loss, what crosses PCIe per step and the tokens/s to expect against resident state.
With ``--stream-weights`` a plan with the bf16 weights streamed from pinned host memory follows
(:mod:`optstate_core.apps.plan_stream`: resident layers, GPU and host bytes, PCIe per step, tokens/s).
"""
from __future__ import annotations

import argparse
import logging
import math
import re
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import torch

from ..tuning import Tuning
from .model_shapes import (NamedShapes, approximate_shapes, checkpointed_activation_bytes,
                           config_shapes, load_config, parse_batch, parse_count)

log = logging.getLogger("optstate.plan")


#: state tensors per parameter of each optimizer (same shape as the parameter)
OPTIMIZER_STATES = {
    "adamw": ("exp_avg", "exp_avg_sq"),
    "adam": ("exp_avg", "exp_avg_sq"),
    "sgd": ("momentum_buffer",),
    "rmsprop": ("square_avg",),
    "adagrad": ("sum",),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
AFTER_WARMUP = 10**9  # the step at which policies are asked: any warmup is long over
STAGING_BYTES = 256 * 2**20  # wrap(staging_bytes=...)'s default: the ring offloaded state streams through
RELEASE_BUCKET_BYTES = 256 * 2**20  # wrap(release_bucket_bytes=...)'s default
MIN_BUDGET_ROW = 2**30  # the smallest gpu_budget the plan offers as a row of its own
#: host <-> device bytes per second each way while both directions copy at once (one H100: 85-88
#: GB/s in both directions together, 53-55 GB/s one way alone; docs/benchmarks-journal.md section 23)
PCIE_BYTES_PER_S = 42e9
#: the preset a "gpu_budget" row is built from (resident up to the budget, the rest streamed)
BUDGET_PRESET = "bf16w-4bit-lean"
# of the GPU left free beside a gpu_budget row (allocator fragmentation, cuBLAS workspaces): at 8B, 24 GB,
# micro-batch 1 a 3 GiB budget peaked at 21.19 GiB of the 22.35 allowed (docs/benchmarks-journal.md section 29)
BUDGET_MARGIN = 0.025


# -- state bytes ----------------------------------------------------------------------------
@dataclass
class StateBytes:
    device: int = 0
    host: int = 0
    by_codec: Dict[str, int] = field(default_factory=dict)
    correction_device: int = 0  # master-weight correction (part of device / host)
    correction_host: int = 0

    @property
    def total(self) -> int:
        return self.device + self.host

    def add(self, key: str, codec: str, tier: str, nbytes: int) -> None:
        """Count one state of ``nbytes`` in ``codec`` on ``tier`` ("host" or the device)."""
        from ..state.master_weights import MASTER_KEY
        on_host = tier == "host"
        self.host += nbytes if on_host else 0
        self.device += 0 if on_host else nbytes
        if key == MASTER_KEY:
            self.correction_host += nbytes if on_host else 0
            self.correction_device += 0 if on_host else nbytes
        self.by_codec[codec] = self.by_codec.get(codec, 0) + nbytes


def state_bytes(shapes: NamedShapes, preset: Optional[str], optimizer: str = "adamw",
                dtype: torch.dtype = torch.float32) -> StateBytes:
    """Bytes of optimizer state between steps: the preset's policy picks codec and tier per
    (parameter, state key); ``preset=None`` is the unwrapped torch optimizer (raw tensors). A
    preset with master weights sees bf16 parameters, keeps its state in fp32 and adds the
    ``master_correction`` state."""
    out = StateBytes()
    for entries in param_states(shapes, preset, optimizer, dtype):
        for key, codec, tier, nbytes in entries:
            out.add(key, codec.name, tier, nbytes)
    return out


def param_states(shapes: NamedShapes, preset: Optional[str], optimizer: str, dtype: torch.dtype):
    """Per parameter, its states as the preset's policy stores them after warmup: a list of
    ``(state key, codec, tier, bytes)``."""
    from ..state.codecs import FP32Codec
    from ..state.codecs.base import slab_shape
    from ..state.master_weights import MASTER_KEY
    from ..policy import ParamInfo
    from ..presets import has_master_weights, make_policy
    policy = make_policy(preset) if preset is not None else None
    master = has_master_weights(preset)
    if master:
        dtype = torch.float32
    keys = OPTIMIZER_STATES[optimizer] + ((MASTER_KEY,) if master else ())
    for index, (name, shape) in enumerate(shapes):
        info = ParamInfo(index, 0, tuple(shape), torch.bfloat16 if master else dtype, name)
        rows, cols = slab_shape(shape)
        entries = []
        for key in keys:
            if policy is None:
                codec, tier = FP32Codec(), "device"
            else:
                codec = policy.codec_for(info, key, AFTER_WARMUP)
                tier = policy.tier_for(info, key, AFTER_WARMUP)
            entries.append((key, codec, tier, codec.nbytes(rows, cols, dtype)))
        yield entries


@dataclass
class PlanRow:
    name: str
    state: StateBytes
    total_gpu: int
    fits: bool
    bits_per_param: float
    weights: int = 0  # this row's parameter bytes (bf16 for master-weight presets)
    grads: int = 0  # this row's gradient bytes at the step's peak
    staging: int = 0  # the staging ring that host-resident state streams through (and, with release, staged batches)
    gpu_budget: Optional[int] = None  # a row that keeps state resident up to this many bytes

    @property
    def pcie_bytes(self) -> int:
        """Bytes that cross PCIe each way per step: the state kept in host memory."""
        return self.state.host


@dataclass
class Plan:
    n_params: int
    weights: int
    grads: int
    activations: int
    gpu_memory: int
    rows: List[PlanRow]
    optimizer: str
    source: str
    weights_dtype: str = "fp32"
    release_gradients: bool = False
    pcie_bytes_per_s: float = PCIE_BYTES_PER_S
    gpus: int = 1  # FSDP2 ranks: every figure is per GPU

    def best(self) -> Optional[PlanRow]:
        """The row that fits with the least state in host memory (then the fewest GPU bytes); with
        bf16 weights, rows that keep fp32 master weights (``bf16w-*``) first: the others update
        the bf16 weights themselves, which is not AdamW's trajectory."""
        from ..presets import has_master_weights
        fitting = [r for r in self.rows if r.fits and not r.name.startswith("torch ")]
        lossy = (lambda r: not has_master_weights(r.name.split(" + ")[0])) if self.weights_dtype == "bf16" else \
            (lambda r: False)
        return min(fitting, key=lambda r: (lossy(r), r.state.host, r.total_gpu), default=None)


def make_plan(shapes: NamedShapes, gpu_memory: int, optimizer: str = "adamw", presets: Sequence[str] = (),
              weights_dtype: str = "fp32", grads_dtype: Optional[str] = None, activations: int = 0,
              source: str = "", release_gradients: bool = False, staging_bytes: int = STAGING_BYTES,
              release_bucket_bytes: int = RELEASE_BUCKET_BYTES, pcie_bytes_per_s: float = PCIE_BYTES_PER_S,
              gpus: int = 1) -> Plan:
    """Per preset (and for the unwrapped optimizer first): state on GPU and host, the GPU total
    (weights + grads + state on GPU + activations + the staging ring if state is on the host)
    and whether it fits in ``gpu_memory``. Master-weight presets (``bf16w-*``) hold bf16 weights
    and bf16 gradients whatever the dtypes given. With ``release_gradients`` every preset's
    gradients count as one release batch (``release_bucket_bytes`` plus the largest parameter's
    gradient; the unwrapped optimizer keeps them all). When ``bf16w-4bit-lean`` does not fit but
    the GPU has room beside its weights, a row with ``gpu_budget`` (state resident up to what is
    left, the rest streamed) is added. ``gpus`` > 1: FSDP2 over that many GPUs, every figure per
    GPU: weights, gradients and state divided by the ranks, plus an estimate of FSDP2's buffers
    (units: :func:`fsdp_units`): the root unit's weights gathered for the whole step, the largest
    layer's twice (the current and the prefetched one), and the larger of the two's unsharded
    gradients before their reduce-scatter."""
    from ..metrics import bits_per_param
    from ..presets import has_master_weights
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"--optimizer must be one of {', '.join(OPTIMIZER_STATES)}, got {optimizer!r}")
    for arg, value in (("--weights-dtype", weights_dtype), ("--grads-dtype", grads_dtype or weights_dtype)):
        if value not in DTYPES:
            raise ValueError(f"{arg} must be one of {', '.join(DTYPES)}, got {value!r}")
    if not pcie_bytes_per_s > 0:
        raise ValueError(f"--pcie-gbps must be a positive number, got {pcie_bytes_per_s / 1e9!r}")
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise ValueError(f"--gpus must be an integer >= 1, got {gpus!r}")
    wdtype, gdtype = DTYPES[weights_dtype], DTYPES[grads_dtype or weights_dtype]
    n = sum(math.prod(s) for _, s in shapes)
    weights = n * _itemsize(wdtype)
    grads = n * _itemsize(gdtype)
    rows = []
    largest = max((math.prod(s) for _, s in shapes), default=0)
    units = fsdp_units(shapes) if gpus > 1 else {}
    root = units.pop("root", 0)  # FSDP2 keeps the root's parameters gathered from forward to backward's end
    layer = max(units.values(), default=0)  # the largest other unit: gathered twice (current, prefetched)
    ahead = Tuning.from_env().stage_ahead  # wrap()'s default (OPTSTATE_STAGE_AHEAD, else 2)

    def released(itemsize: int) -> int:  # gradient bytes alive at once when released in backward (per rank)
        return min(-(-n // gpus) * itemsize, release_bucket_bytes + -(-largest // gpus) * itemsize)

    def staged_ahead(host: int, gsize: int) -> int:
        """Host state that release stages ahead (per rank): the next ``tuning.stage_ahead`` batches' and
        the updating one's, at most the largest parameter's batch plus that many ordinary ones."""
        if not (release_gradients and host and n):
            return 0
        return min(host, (-(-largest // gpus) + ahead * release_bucket_bytes // max(gsize, 1)) * host * gpus // n)

    def row(preset, st, budget=None):
        w, g = weights, grads
        if has_master_weights(preset):
            w, g = 2 * n, 2 * n
        wsize, gsize = (w // n, g // n) if n else (0, 0)
        w, g = -(-w // gpus), -(-g // gpus)
        if release_gradients and preset is not None:
            g = released(gsize)
        bits = bits_per_param(st.total, n)
        if gpus > 1:
            st = _per_rank(st, gpus)
            w += (root + 2 * layer) * wsize + max(root, layer) * gsize  # FSDP2's gathered units, unsharded grads
        staging = min(staging_bytes, budget // 2) if budget is not None else (staging_bytes if st.host else 0)
        if preset is not None:
            staging += staged_ahead(st.host, gsize)
        total = w + g + st.device + activations + staging
        name = f"torch {optimizer}" if preset is None else preset
        if budget is not None:
            name = f"{preset} + gpu_budget={budget / 2**30:.2f}GiB"
        return PlanRow(name, st, total, total <= gpu_memory, bits, w, g, staging, budget)

    for preset in [None, *presets]:
        rows.append(row(preset, state_bytes(shapes, preset, optimizer, wdtype)))
    resident = next((r for r in rows if r.name == BUDGET_PRESET), None)
    if resident is not None and not resident.fits:
        # what the state may take on the GPU, keeping BUDGET_MARGIN of the card for the allocator
        # (less the ring and what release would stage ahead if all of the state streamed; the
        # row's state is per rank already, its gradients bf16)
        room = int(gpu_memory * (1 - BUDGET_MARGIN)) - (resident.total_gpu - resident.state.device) - \
            staging_bytes - staged_ahead(resident.state.total, 2)
        if room >= MIN_BUDGET_ROW:  # (a smaller budget streams nearly everything: the -offload row says it)
            st = budget_state_bytes(shapes, BUDGET_PRESET, optimizer, room * gpus)  # every rank in the same order
            rows.append(row(BUDGET_PRESET, st, budget=room))
    return Plan(n, weights, grads, activations, gpu_memory, rows, optimizer, source, weights_dtype,
                release_gradients, pcie_bytes_per_s, gpus)


def fsdp_units(shapes: NamedShapes) -> Dict[str, int]:
    """Elements per FSDP2 unit, as ``fully_shard`` is applied to each transformer layer and the
    root: a parameter named ``...layers.<i>.`` or ``...h.<i>.`` belongs to its layer, one of
    ``--params``' approximated matrices is a unit of its own, the rest (embeddings, final norm,
    head) to the root."""
    units: Dict[str, int] = {}
    for name, shape in shapes:
        m = re.match(r"^(.*?\.(?:layers|h)\.\d+)\.", name)
        key = m.group(1) if m else (name if name.startswith("params.") else "root")
        units[key] = units.get(key, 0) + math.prod(shape)
    return units


def _per_rank(st: StateBytes, gpus: int) -> StateBytes:
    """One rank's share of the state (every tensor sharded over the ranks)."""
    return StateBytes(-(-st.device // gpus), -(-st.host // gpus), {k: -(-v // gpus) for k, v in st.by_codec.items()},
                      -(-st.correction_device // gpus), -(-st.correction_host // gpus))


def budget_state_bytes(shapes: NamedShapes, preset: str, optimizer: str, budget: int) -> StateBytes:
    """State bytes of ``preset`` under ``gpu_budget=budget``: as the optimizer assigns residency
    (:func:`~optstate_core.schedule.placement.spread_residency`), each parameter's state (moments
    and correction) stays on the GPU or not as a whole, beside the staging ring (half the budget
    at most); the rest is in host memory."""
    from ..schedule.placement import spread_residency
    out = StateBytes()
    params = list(param_states(shapes, preset, optimizer, torch.float32))
    keep = spread_residency([sum(nbytes for *_, nbytes in entries) for entries in params],
                            budget - min(STAGING_BYTES, budget // 2))
    for entries, stays in zip(params, keep):
        for key, codec, _, nbytes in entries:
            out.add(key, codec.name, "device" if stays else "host", nbytes)
    return out


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def format_plan(plan: Plan) -> str:
    released = " (released in backward: a batch at a time)" if plan.release_gradients else ""
    sharded = f"; FSDP2 over {plan.gpus} GPUs, every figure per GPU (FSDP2's all-gather and " \
        "reduce-scatter buffers in 'weights + grads')" if plan.gpus > 1 else ""
    lines = [f"{plan.source}: {plan.n_params:,} parameters ({plan.n_params / 1e9:.3f}B); optimizer {plan.optimizer}"
             + sharded,
             f"weights {gib(plan.weights)} + grads {gib(plan.grads)}{released} in all + activations "
             f"{gib(plan.activations)} per GPU + optimizer state on the GPU; GPU memory {plan.gpu_memory / 1e9:.1f} GB "
             f"= {gib(plan.gpu_memory)}",
             "",
             "| preset | weights + grads | master correction | state on GPU | state on host | bits/param | "
             "GPU bytes/param | total on GPU | fits | host<->GPU per step (each way) | copy time per step |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|"]
    for r in plan.rows:
        corr = f"{gib(r.state.correction_device + r.state.correction_host)}" + (
            " (host)" if r.state.correction_host and not r.state.correction_device else "")
        per_param = (r.total_gpu - plan.activations) * plan.gpus / plan.n_params if plan.n_params else 0.0
        moved = f"{gib(r.pcie_bytes)}" if r.pcie_bytes else "0"
        copy = f"{r.pcie_bytes / plan.pcie_bytes_per_s:.2f} s" if r.pcie_bytes else ""
        lines.append(f"| {r.name} | {gib(r.weights + r.grads)} | {corr} | {gib(r.state.device)} | "
                     f"{gib(r.state.host)} | {r.bits_per_param:.1f} | {per_param:.2f} | "
                     f"{gib(r.total_gpu)} | {'yes' if r.fits else 'no'} | {moved} | {copy} |")
    fitting = [r.name for r in plan.rows if r.fits]
    lines.append("")
    best = plan.best()
    if best is not None:
        lines.append(f"fits: {', '.join(fitting)}")
        lines.append(f"pick: {_how_to_wrap(best, plan)}")
    else:
        lines.append("nothing fits: " + "; ".join(hints(plan)))
    lines.append(f"copy time = state in host memory / {plan.pcie_bytes_per_s / 1e9:.0f} GB/s each way (--pcie-gbps): "
                 "a step's floor when backward cannot hide the copies; larger batches (and gradient accumulation, "
                 "where the gradients fit) hide more of it. The staging ring (256 MiB) counts in rows with host state, "
                 f"and with release the state staged {Tuning.from_env().stage_ahead} batches ahead.")
    lines.append("During step() a compressed preset also materializes up to chunk_bytes (64 MiB by default) of "
                 "full-precision state at a time; offloaded state needs pinned host memory of its size.")
    return "\n".join(lines)


def _how_to_wrap(row: PlanRow, plan: Plan) -> str:
    """The call that builds the chosen row."""
    from ..presets import has_master_weights
    preset = row.name.split(" + ")[0]
    options = [f"{preset!r}"]
    if plan.release_gradients:
        options.append("release_gradients=True")
    if row.gpu_budget is not None:
        options.append(f"gpu_budget={row.gpu_budget}")
    cast = "optstate_core.cast_model(model); " if has_master_weights(preset) else ""
    return f"{row.name}: {cast}optstate_core.wrap(optimizer, {', '.join(options)})"


def hints(plan: Plan) -> List[str]:
    """What could make something fit, given what was already asked for."""
    out = []
    if plan.activations:
        out.append("fewer activations (a smaller batch, activation checkpointing)")
    if plan.weights_dtype != "bf16":
        out.append("bf16 weights (the bf16w-* presets keep fp32 masters as state)")
    if not plan.release_gradients:
        out.append("--release-gradients (free each gradient in backward)")
    smallest = min((r for r in plan.rows if not r.name.startswith("torch ")), key=lambda r: r.total_gpu, default=None)
    if smallest is not None:
        short = smallest.total_gpu - plan.gpu_memory
        more = "more GPUs (--gpus)" if plan.gpus > 1 else "shard the model over GPUs with FSDP2 (--gpus N)"
        out.append(f"the smallest row ({smallest.name}) needs {gib(short)} more than the GPU has: {more} "
                   "(docs/distributed.md)")
    return out


# -- command line ---------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ..presets import PRESETS
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--params", help="parameter count, e.g. 125M, 7B, 6.7e9 (approximated as large "
                     "matrices with rows of 4096; prefer --config for exact numbers)")
    src.add_argument("--config", help="a Hugging Face config.json (Llama, Mistral, Qwen2/3, GPT-2 families): "
                     "exact parameter shapes")
    from .llama import NAMED_SHAPES
    src.add_argument("--model", choices=sorted(NAMED_SHAPES),
                     help="a named Llama shape instead of a config.json: 8b and 70b are Llama-3-8B's and "
                          "Llama-3-70B's, 405b Llama-3.1-405B's, 0.95b the end-to-end benchmark's")
    parser.add_argument("--gpu-memory", default="80GB",
                        help="GPU memory, e.g. 80GB (=80e9 bytes), 24GiB (default: %(default)s)")
    parser.add_argument("--optimizer", default="adamw", choices=sorted(OPTIMIZER_STATES),
                        help="the optimizer being wrapped: adamw/adam keep 2 states per parameter, sgd (momentum), "
                             "rmsprop and adagrad 1 (default: %(default)s)")
    parser.add_argument("--weights-dtype", default="fp32", choices=sorted(DTYPES),
                        help="dtype of the trained (master) weights; optimizer state follows it "
                             "(default: %(default)s)")
    parser.add_argument("--grads-dtype", default=None, choices=sorted(DTYPES),
                        help="dtype of the gradients (default: the weights dtype)")
    parser.add_argument("--release-gradients", action="store_true",
                        help="every optstate preset frees each gradient in backward (wrap(release_gradients=True)): "
                             "count one release batch of gradients (256 MiB plus the largest parameter's)")
    parser.add_argument("--gpus", type=int, default=1,
                        help="FSDP2 over this many GPUs (each transformer layer and the root fully_shard-ed): "
                             "every figure per GPU (default: %(default)s)")
    parser.add_argument("--pcie-gbps", type=float, default=PCIE_BYTES_PER_S / 1e9,
                        help="host<->GPU GB/s each way with both directions busy, for the copy time of rows with "
                             "state in host memory (default: %(default)s, one H100's measured duplex rate)")
    parser.add_argument("--activations", default=None,
                        help="activation memory at your batch size, e.g. 10GB: measure it or estimate it "
                             "(default: 0, or the --batch estimate)")
    parser.add_argument("--batch", default=None,
                        help="sequences x tokens per GPU, e.g. 1x2048, with --config (Llama family): estimate the "
                             "activations with activation checkpointing instead of giving --activations")
    parser.add_argument("--presets", default=",".join(p for p in PRESETS if p != "default"),
                        help="comma-separated presets to show (default: %(default)s)")


def plan_from_args(args) -> Plan:
    from .demo import parse_presets
    from ..state.units import parse_bytes
    gpu = parse_bytes(args.gpu_memory, "--gpu-memory")
    activations = 0 if str(args.activations or 0).strip() in ("0", "") else \
        parse_bytes(args.activations, "--activations")
    if args.batch is not None and args.activations is not None:
        raise ValueError("--batch estimates the activations: give --batch or --activations, not both")
    model = getattr(args, "model", None)
    if args.batch is not None and not (args.config or model):
        raise ValueError("--batch needs --config or --model (the activation estimate uses the model's shapes)")
    if args.config or model:
        if model:
            from .llama import NAMED_SHAPES
            config, source = NAMED_SHAPES[model].hf_config(), f"--model {model} ({NAMED_SHAPES[model].describe()})"
        else:
            config, source = load_config(args.config), args.config
        shapes = config_shapes(config)
        if args.batch is not None:
            batch, seq = parse_batch(args.batch)
            activations = checkpointed_activation_bytes(config, batch, seq)
            source += f", batch {batch}x{seq} per GPU (activations estimated with checkpointing)"
    else:
        n = parse_count(args.params)
        shapes, source = approximate_shapes(n), f"--params {args.params} (approximate shapes)"
    return make_plan(shapes, gpu, args.optimizer, parse_presets(args.presets), args.weights_dtype,
                     args.grads_dtype, activations, source, release_gradients=args.release_gradients,
                     pcie_bytes_per_s=args.pcie_gbps * 1e9, gpus=args.gpus)
