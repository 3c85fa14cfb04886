"""``optstate plan --stream-weights``: the bf16 weights streamed from pinned host memory (a planner estimate).

What ``stream_weights`` does (schedule/weight_stream.py): the bf16 weights live in pinned host memory;
a GPU window of ``window`` decoder layers (the one in use, the prefetched one, and the one whose
update is still pending) is filled ahead of each layer's forward and again ahead of its recompute +
backward (activation checkpointing, one checkpoint per layer); the fused release step updates the
GPU copy and writes it back, and the release batch shrinks to a layer. The
embeddings, final norm and lm_head stay on the GPU (needed at both ends of forward and first in
backward). Resident layers are not streamed: the planner keeps as many as fit, because a resident
layer saves three copies of its weights (two in, one out) per GPU byte, more than anything else
saves. Then the state (the preset's codecs, :func:`~optstate_core.apps.plan.param_states`) that the
preset keeps on the GPU stays there as far as room is left, the embeddings' first, then layer by
layer; the rest lives in host memory and crosses PCIe both ways per step. The layer checkpoints
(each layer's saved input) stay on the GPU or, when that streams fewer bytes, live in host memory
(``offload_activations``, ``--offload-activations``; or the planner's choice under
``host_activations_cap``, ``--host-activations``, 0 by default): out in forward, in during backward,
the last two layers' and the one prefetched staying on the GPU. ``resident_layers`` and
``state_budget`` (``gpu_budget``) fix what the greedy choice would pick, to plan a run as it is set up. The recomputed layer's
working set and the fused (chunked) loss's stay on the GPU.

``gpus`` > 1: a node, every figure per GPU. Each GPU holds its FSDP2 shard of the resident layers'
weights and streams its shard of the others, then all-gathers them; FSDP2's buffers are counted as
in :func:`~optstate_core.apps.plan.make_plan` (the root gathered all step, the largest layer twice,
the larger one's unsharded gradients). Each GPU is assumed to have a PCIe link of its own.

Times: copies at the measured one-way rate, the part where both directions copy at once at the
duplex rate; compute = 8 x params x tokens FLOPs (forward, recompute, backward) at ``tflops``. A
step takes at least max(compute, copies), so tokens / that is an upper bound on tokens/s.
"""
from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch

from ..tuning import Tuning
from .model_shapes import NamedShapes, checkpointed_activation_bytes, config_shapes, parse_batch
from .plan import BUDGET_MARGIN, RELEASE_BUCKET_BYTES, STAGING_BYTES, gib, param_states

log = logging.getLogger("optstate.plan")

DEFAULT_PRESET = "bf16w-4bit-lean"
DEFAULT_WINDOW = 3  # streamed layers on the GPU at once: in use, prefetched, awaiting its update (prefetch=1)
#: pinned host<->device bytes/s on one H200 (docs/benchmarks-journal.md, its header; tools/duplex_bandwidth.py):
#: 55.3 GB/s one way alone, 101.6 GB/s in total with both directions copying at once (50.8 each way)
PCIE_ONE_WAY = 55.3e9
PCIE_DUPLEX = 50.8e9
#: achieved bf16 TFLOP/s per GPU with checkpointing, counted as 8 x params x tokens: Llama-3-70B shapes under
#: FSDP2 on 4 x H200, 1 x 4096 per rank, no optimizer, 4,649 ms per iteration (BENCHMARKS.md, H200s 2026-11-28):
#: 8 x 70.55e9 x 4096 / 4.649 s = 497 TFLOP/s, about half the H200's dense bf16 peak
DEFAULT_TFLOPS = 500.0
HOST_ACTIVATIONS_CAP = 0  # pinned host memory the layer checkpoints may take (the planner's choice; off by default)
KEPT_CHECKPOINTS = 3  # offloaded, the GPU still holds the last prefetch + 1 = 2 layers' inputs and the prefetched one
#: host memory a training process holds beside its pinned bytes: 38.55 GiB RSS per rank for 33.88 GiB of pinned
#: state (Llama-3-70B, 4 x H100, shared pinned slabs; docs/benchmarks-journal.md section 28): the process itself
#: (2.0 GiB measured without an optimizer), CUDA's host allocations and the slabs' slack
HOST_OVERHEAD = int(4.7 * 2**30)
BF16 = 2
RELEASE_PART = "release bucket (bf16 gradients)"
LAYER_NAME = re.compile(r"^(.*?\.(?:layers|h)\.\d+)\.")


@dataclass
class Unit:
    """One decoder layer, or the root (embeddings, final norm, lm_head): elements and state bytes."""
    name: str
    params: int = 0
    largest: int = 0
    state_gpu: int = 0  # state the preset keeps on the GPU (it moves to the host when there is no room)
    state_host: int = 0  # state the preset keeps in host memory


@dataclass
class StreamPlan:
    """Per GPU: the GPU bytes by part, pinned host bytes by part, PCIe bytes per step each way, times."""
    source: str
    preset: str
    gpu_memory: int
    gpus: int
    batch: int
    seq: int
    n_params: int
    layers: int
    window: int
    resident_layers: int
    checkpoints_on_host: bool
    gpu: Dict[str, int] = field(default_factory=dict)
    host: Dict[str, int] = field(default_factory=dict)
    pcie_in: Dict[str, int] = field(default_factory=dict)
    pcie_out: Dict[str, int] = field(default_factory=dict)
    forward_in: int = 0  # of pcie_in, what forward brings in (the streamed weights, once)
    tflops: float = DEFAULT_TFLOPS
    one_way: float = PCIE_ONE_WAY
    duplex: float = PCIE_DUPLEX

    @property
    def streamed_layers(self) -> int:
        """Decoder layers whose weights stream (the rest are resident)."""
        return self.layers - self.resident_layers

    @property
    def gpu_total(self) -> int:
        """Every GPU part together, the margin included."""
        return sum(self.gpu.values())

    @property
    def pinned(self) -> int:
        """Pinned host bytes per GPU (per process)."""
        return sum(self.host.values())

    @property
    def rss(self) -> int:
        """The host memory one process should be expected to hold: pinned + :data:`HOST_OVERHEAD`."""
        return self.pinned + HOST_OVERHEAD

    @property
    def tokens(self) -> int:
        """Tokens per GPU per step."""
        return self.batch * self.seq

    def copy_seconds(self) -> float:
        """Copies per step: both directions at once at the duplex rate, the rest of one at the one-way rate."""
        return copy_seconds(sum(self.pcie_in.values()), sum(self.pcie_out.values()), self.one_way, self.duplex)

    def compute_seconds(self, tokens: Optional[int] = None) -> float:
        """Forward, recompute and backward: 8 x params x tokens FLOPs at ``tflops``."""
        return 8 * self.n_params * (self.tokens if tokens is None else tokens) / (self.tflops * 1e12)

    def tokens_to_hide(self) -> int:
        """Tokens per GPU per step at which compute takes as long as this plan's copies."""
        return math.ceil(self.copy_seconds() * self.tflops * 1e12 / (8 * self.n_params)) if self.n_params else 0

    def tokens_to_hide_forward(self) -> int:
        """Tokens at which forward (2 of the 8 x params FLOPs) takes as long as its weights in, checkpoints out."""
        out = self.pcie_out.get("checkpoints", 0)
        seconds = copy_seconds(self.forward_in, out, self.one_way, self.duplex)
        return math.ceil(seconds * self.tflops * 1e12 / (2 * self.n_params)) if self.n_params else 0

    def tokens_per_s(self) -> float:
        """Tokens / max(compute, copies) per GPU: the copies hidden at best, so an upper bound."""
        return self.tokens / max(self.compute_seconds(), self.copy_seconds())


def copy_seconds(bytes_in: int, bytes_out: int, one_way: float, duplex: float) -> float:
    """Seconds to copy ``bytes_in`` and ``bytes_out``: the common part at ``duplex``, the rest at ``one_way``."""
    both = min(bytes_in, bytes_out)
    return both / duplex + (max(bytes_in, bytes_out) - both) / one_way


def units(shapes: NamedShapes, preset: str) -> Tuple[Unit, List[Unit]]:
    """The root and the decoder layers (names ``...layers.<i>.`` or ``...h.<i>.``), with the preset's state bytes."""
    root, layers = Unit("root"), {}
    for (name, shape), entries in zip(shapes, param_states(shapes, preset, "adamw", torch.float32)):
        m = LAYER_NAME.match(name)
        unit = layers.setdefault(m.group(1), Unit(m.group(1))) if m else root
        unit.params += math.prod(shape)
        unit.largest = max(unit.largest, math.prod(shape))
        for _, _, tier, nbytes in entries:
            if tier == "host":
                unit.state_host += nbytes
            else:
                unit.state_gpu += nbytes
    return root, list(layers.values())


def check_stream_args(gpu_memory: int, window: int, gpus: int, tflops: float, one_way: float, duplex: float,
                      preset: str) -> None:
    """Reject bad arguments, naming the option."""
    from ..presets import PRESETS, has_master_weights
    for arg, value, low in (("--window", window, 1), ("--gpus", gpus, 1), ("--gpu-memory", gpu_memory, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{arg} must be an integer >= {low}, got {value!r}")
    for arg, value in (("--stream-tflops", tflops), ("--stream-gbps", one_way), ("--stream-duplex-gbps", duplex)):
        if not (isinstance(value, (int, float)) and value > 0):
            raise ValueError(f"{arg} must be a positive number, got {value!r}")
    if preset not in PRESETS or not has_master_weights(preset):
        masters = sorted(p for p in PRESETS if has_master_weights(p))
        raise ValueError(f"--stream-preset must be a preset with bf16 weights and fp32 masters ({', '.join(masters)}), "
                         f"got {preset!r}")


def shard(n: int, gpus: int) -> int:
    """One rank's share of ``n`` (rounded up)."""
    return -(-n // gpus)


def fixed_parts(root: Unit, layers: List[Unit], gpus: int, working: int, margin: int,
                release_bucket_bytes: int) -> Dict[str, int]:
    """The GPU parts that do not depend on the resident layers: root weights, FSDP2 buffers, gradients, working set."""
    largest = max([root.largest] + [u.largest for u in layers])
    layer = max((u.params for u in layers), default=0)
    parts = {"embeddings + lm_head (resident)": shard(root.params, gpus) * BF16}
    if gpus > 1:  # the root gathered all step, the largest layer twice, the larger one's unsharded gradients
        parts["FSDP2 gathered weights and gradients"] = (root.params + 2 * layer + max(root.params, layer)) * BF16
    # a layer's gradients (a batch of them) meet its recompute; the embeddings' and lm_head's come at
    # the two ends of backward, when no layer is recomputed: they count only beyond that
    largest_layer = max([u.largest for u in layers], default=largest)
    parts[RELEASE_PART] = release_part(root, layers, gpus, release_bucket_bytes)
    parts["recomputed layer + fused loss"] = working
    beyond = (shard(largest, gpus) - shard(largest_layer, gpus)) * BF16 - working
    if beyond > 0:
        parts["embedding or lm_head gradient beyond a layer's"] = beyond
    parts["margin"] = margin
    return parts


def release_part(root: Unit, layers: List[Unit], gpus: int, release_bucket_bytes: int) -> int:
    """A batch of released bf16 gradients: ``release_bucket_bytes`` pending plus the layers' largest."""
    n = root.params + sum(u.params for u in layers)
    largest_layer = max([u.largest for u in layers], default=root.largest)
    return min(shard(n, gpus) * BF16, release_bucket_bytes + shard(largest_layer, gpus) * BF16)


def staged_ahead(root: Unit, layers: List[Unit], gpus: int, release_bucket_bytes: int) -> int:
    """State that release stages ahead of its update if all of it lived on the host (as make_plan counts it)."""
    n = root.params + sum(u.params for u in layers)
    state = sum(u.state_gpu + u.state_host for u in [root, *layers])
    largest = max([root.largest] + [u.largest for u in layers])
    if not (n and state):
        return 0
    return min(shard(state, gpus), (shard(largest, gpus) + Tuning.from_env().stage_ahead * release_bucket_bytes // BF16) * state // n)


def fill(plan: StreamPlan, root: Unit, layers: List[Unit], base: Dict[str, int], ring: int,
         resident_layers: Optional[int] = None, state_budget: Optional[int] = None,
         release_bucket_bytes: int = RELEASE_BUCKET_BYTES) -> bool:
    """Fill ``plan``: most layers resident beside ``base`` (+ ring), then state; False if the window does not fit.
    ``resident_layers``/``state_budget``: as given instead of as many as fit."""
    g, count = plan.gpus, len(layers)
    weights = shard(max((u.params for u in layers), default=0), g) * BF16  # a layer's (shard of) weights
    all_state = sum(shard(u.state_gpu, g) for u in [root, *layers])
    no_host_state = not any(u.state_host for u in [root, *layers])
    room = plan.gpu_memory - sum(base.values())
    wanted = range(count, -1, -1) if resident_layers is None else [min(resident_layers, count)]
    if no_host_state and room >= count * weights + all_state and resident_layers in (None, count) \
            and state_budget is None:  # everything resident, no ring
        kept, plan.gpu, plan.resident_layers = count, dict(base), count
    else:
        kept = next((k for k in wanted if k * weights + min(plan.window, count - k) * weights + ring <= room), None)
        if kept is None:
            return False
        plan.gpu, plan.resident_layers = dict(base), kept
        plan.gpu["staging ring + staged state"] = ring
        room -= ring
    streamed = count - kept
    if streamed and release_bucket_bytes > weights:  # stream_weights lowers the release batch to a layer's
        lowered = release_part(root, layers, g, weights)
        room += plan.gpu[RELEASE_PART] - lowered
        plan.gpu[RELEASE_PART] = lowered
    if state_budget is not None:
        room = min(room, state_budget + (kept + min(plan.window, streamed)) * weights)
    plan.gpu["resident layers' weights"] = kept * weights
    plan.gpu["window of streamed layers"] = min(plan.window, streamed) * weights
    room -= (kept + min(plan.window, streamed)) * weights
    on_gpu = host_state = 0
    for u in [root, *layers]:  # the root's state first, then layer by layer
        s = shard(u.state_gpu, g)
        if s <= room:
            on_gpu, room = on_gpu + s, room - s
        else:
            host_state += s
        host_state += shard(u.state_host, g)
    plan.gpu["state on GPU"] = on_gpu
    _traffic(plan, streamed * weights, host_state)
    return True


def _traffic(plan: StreamPlan, streamed: int, host_state: int) -> None:
    """Pinned host bytes and PCIe bytes each way, from the streamed weights, host state and checkpoints."""
    ckpt = plan.host.get("checkpoints", 0)
    plan.host = {"streamed weights (bf16)": streamed, "state": host_state, **({"checkpoints": ckpt} if ckpt else {})}
    plan.pcie_in = {"weights (forward, recompute + backward)": 2 * streamed, "state": host_state}
    plan.pcie_out = {"weights (updated bf16)": streamed, "state": host_state}
    if ckpt:
        plan.pcie_in["checkpoints"] = plan.pcie_out["checkpoints"] = ckpt
    plan.forward_in = streamed


def stream_plan(shapes: NamedShapes, config: dict, gpu_memory: int, batch: int = 1, seq: int = 2048,
                preset: str = DEFAULT_PRESET, window: int = DEFAULT_WINDOW, gpus: int = 1,
                tflops: float = DEFAULT_TFLOPS, one_way: float = PCIE_ONE_WAY, duplex: float = PCIE_DUPLEX,
                host_activations_cap: int = HOST_ACTIVATIONS_CAP, margin: float = BUDGET_MARGIN,
                staging_bytes: int = STAGING_BYTES, release_bucket_bytes: int = RELEASE_BUCKET_BYTES,
                source: str = "", resident_layers: Optional[int] = None,
                state_budget: Optional[int] = None, offload_activations: Optional[bool] = None) -> StreamPlan:
    """The weight-streaming plan per GPU (module doc); ValueError naming the option if bad or nothing fits."""
    check_stream_args(gpu_memory, window, gpus, tflops, one_way, duplex, preset)
    root, layers = units(shapes, preset)
    if not layers:
        raise ValueError("--stream-weights needs decoder layers (parameters named ...layers.<i>. or ...h.<i>.)")
    activations = checkpointed_activation_bytes(config, batch, seq, fused_loss=True)
    checkpoints = batch * seq * len(layers) * int(_text(config)["hidden_size"]) * BF16
    base = fixed_parts(root, layers, gpus, activations - checkpoints, int(margin * gpu_memory), release_bucket_bytes)
    ring = staging_bytes + staged_ahead(root, layers, gpus, release_bucket_bytes)
    n = root.params + sum(u.params for u in layers)
    options = []
    kept = checkpoints * min(KEPT_CHECKPOINTS, len(layers)) // len(layers)
    kept_last = checkpoints * min(KEPT_CHECKPOINTS - 1, len(layers)) // len(layers)  # never leave the GPU
    for on_host in ((False, True) if offload_activations is None else (offload_activations,)):
        if on_host and offload_activations is None and checkpoints > host_activations_cap:
            continue
        p = StreamPlan(source, preset, gpu_memory, gpus, batch, seq, n, len(layers), window, 0, on_host,
                       host={"checkpoints": checkpoints - kept_last} if on_host else {}, tflops=tflops, one_way=one_way,
                       duplex=duplex)
        if fill(p, root, layers, {**base, "layer checkpoints": kept if on_host else checkpoints}, ring,
                resident_layers, state_budget, release_bucket_bytes):
            options.append(p)
    if not options:
        window_bytes = min(window, len(layers)) * shard(max(u.params for u in layers), gpus) * BF16
        on_host = offload_activations if offload_activations is not None else checkpoints <= host_activations_cap
        need = sum(base.values()) + ring + window_bytes + (kept if on_host else checkpoints)
        raise ValueError(f"--gpu-memory {gpu_memory:,} bytes is too small to stream the weights: the window of "
                         f"{window} layers, the embeddings and lm_head, the gradients, the staging ring, the "
                         f"activations and the margin need {need:,} bytes = {gib(need)} at least")
    return min(options, key=lambda p: (sum(p.pcie_in.values()) + sum(p.pcie_out.values()), p.checkpoints_on_host))


def _text(config: dict) -> dict:
    """A multimodal config's language model (its ``text_config``), else the config."""
    return config["text_config"] if "text_config" in config and "hidden_size" not in config else config


# -- output and command line ----------------------------------------------------------------------
def format_stream(p: StreamPlan) -> str:
    """The streaming plan as ``optstate plan --stream-weights`` prints it: one row, its parts, hints."""
    node = f"FSDP2-sharded over {p.gpus} GPUs, every figure per GPU" if p.gpus > 1 else "one GPU"
    lines = [f"## Weight streaming (planner estimate): {p.source}; {p.preset}, gradient release, activation "
             f"checkpointing, fused loss; micro-batch {p.batch} x {p.seq} per GPU; {node} of "
             f"{p.gpu_memory / 1e9:.1f} GB = {gib(p.gpu_memory)}", "",
             "| resident layers | streamed (window) | GPU total | pinned host | RSS | PCIe in / out per step | "
             "copies | compute | tokens to hide | tokens/s (upper bound) |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|", stream_row(p), "",
             "| part | GiB |", "|---|---:|"]
    lines += [f"| GPU: {k} | {v / 2**30:.2f} |" for k, v in p.gpu.items()]
    lines += [f"| host (pinned): {k} | {v / 2**30:.2f} |" for k, v in p.host.items() if v]
    lines += [f"| PCIe in: {k} | {v / 2**30:.2f} |" for k, v in p.pcie_in.items() if v]
    lines += [f"| PCIe out: {k} | {v / 2**30:.2f} |" for k, v in p.pcie_out.items() if v]
    return "\n".join(lines + [""] + stream_hints(p))


def stream_row(p: StreamPlan) -> str:
    """The plan's summary row."""
    moved_in, moved_out = sum(p.pcie_in.values()), sum(p.pcie_out.values())
    return (f"| {p.resident_layers} of {p.layers} | {p.streamed_layers} ({min(p.window, p.streamed_layers)}) | "
            f"{gib(p.gpu_total)} | {gib(p.pinned)} | {gib(p.rss)} | "
            f"{moved_in / 2**30:.1f} / {moved_out / 2**30:.1f} GiB"
            f" | {p.copy_seconds():.2f} s | {p.compute_seconds():.2f} s | {p.tokens_to_hide():,} | "
            f"{p.tokens_per_s():,.0f} |")


def stream_hints(p: StreamPlan) -> List[str]:
    """One-line explanations and hints under the table."""
    out = ["- embeddings, final norm and lm_head stay on the GPU; "
           + (f"{p.streamed_layers} layers stream through a window of {min(p.window, p.streamed_layers)} (--window): "
              "in before forward and again before recompute + backward, the updated bf16 copy out"
              if p.streamed_layers else "every layer is resident: nothing streams but the state kept on the host"),
           "- layer checkpoints " + ("in pinned host memory (out in forward, in during backward)"
                                     if p.checkpoints_on_host else "on the GPU"),
           f"- RSS = pinned + {gib(HOST_OVERHEAD)} per process (the process, CUDA's host memory and the pinned "
           "slabs' slack, from a measured 70B run)" + (f"; the node holds {gib(p.rss * p.gpus)} ({p.gpus} processes)"
                                                       if p.gpus > 1 else ""),
           f"- copies at {p.one_way / 1e9:g} GB/s one way, {p.duplex / 1e9:g} GB/s each way when both directions copy "
           f"(--stream-gbps, --stream-duplex-gbps); compute = 8 x params x tokens at {p.tflops:g} TFLOP/s "
           "(--stream-tflops)",
           f"- tokens/s = tokens / max(compute, copies): a step takes at least that long, so this is an upper bound; "
           f"{p.tokens_to_hide():,} tokens per GPU per step hide the copies",
           f"- forward alone (2 of the 8 x params FLOPs) must hide its own copies (the streamed weights in once, host "
           f"checkpoints out): {p.tokens_to_hide_forward():,} tokens per GPU per step",
           "- planner estimates, not measurements (what was measured: BENCHMARKS.md, weight streaming)"]
    if p.streamed_layers and p.tokens < p.tokens_to_hide():
        out.append(f"- hint: a micro-batch toward {p.tokens_to_hide():,} tokens, more GPU memory or more GPUs (--gpus) "
                   "stream less per token (gradient accumulation streams the weights again every micro-batch)")
    return out


def add_arguments(parser) -> None:
    """The weight-streaming options of ``optstate plan``."""
    g = parser.add_argument_group("weight streaming (--stream-weights)")
    g.add_argument("--stream-weights", action="store_true",
                   help="after the table, a plan with the bf16 weights streamed from pinned host memory (needs "
                        "--model or a Llama-family --config; --batch, else 1 x --seq tokens per GPU; --gpus N: a node)")
    g.add_argument("--window", type=int, default=DEFAULT_WINDOW,
                   help="streamed layers on the GPU at once (default: %(default)s: in use + prefetched)")
    g.add_argument("--stream-preset", default=DEFAULT_PRESET, help="a bf16w-* preset (default: %(default)s)")
    g.add_argument("--stream-tflops", type=float, default=DEFAULT_TFLOPS,
                   help="achieved bf16 TFLOP/s per GPU (default: %(default)s, 70B on 4 x H200 measured 497)")
    g.add_argument("--stream-gbps", type=float, default=PCIE_ONE_WAY / 1e9,
                   help="pinned host<->GPU GB/s one way (default: %(default)s, one H200)")
    g.add_argument("--stream-duplex-gbps", type=float, default=PCIE_DUPLEX / 1e9,
                   help="GB/s each way with both directions copying (default: %(default)s, one H200)")
    g.add_argument("--offload-activations", action="store_true",
                   help="the layer checkpoints in pinned host memory, as wrap(offload_activations=True) does")
    g.add_argument("--host-activations", default="0",
                   help="pinned host memory the layer checkpoints may take where that streams fewer bytes (the "
                        "planner's choice; default 0: on the GPU, as without offload_activations)")
    g.add_argument("--resident-layers", type=int, default=None,
                   help="decoder layers kept on the GPU (default: as many as fit)")
    g.add_argument("--state-budget", default=None,
                   help="optimizer state kept on the GPU, as wrap(gpu_budget=...) (default: as much as fits)")


def stream_from_args(args) -> Optional[StreamPlan]:
    """The streaming plan ``optstate plan --stream-weights`` prints, None without the flag."""
    from ..state.units import parse_bytes
    if not getattr(args, "stream_weights", False):
        return None
    model = getattr(args, "model", None)
    if not (model or args.config):
        raise ValueError("--stream-weights needs --model or a Llama-family --config (per-layer shapes), not --params")
    if model:
        from .llama import NAMED_SHAPES
        config, source = NAMED_SHAPES[model].hf_config(), f"--model {model}"
    else:
        from .model_shapes import load_config
        config, source = load_config(args.config), args.config
    batch, seq = parse_batch(args.batch) if args.batch is not None else (1, args.seq)
    return stream_plan(config_shapes(config), config, parse_bytes(args.gpu_memory, "--gpu-memory"), batch, seq,
                       args.stream_preset, args.window, args.gpus, args.stream_tflops, args.stream_gbps * 1e9,
                       args.stream_duplex_gbps * 1e9, parse_bytes(args.host_activations, "--host-activations", True),
                       source=source, resident_layers=args.resident_layers,
                       offload_activations=True if getattr(args, "offload_activations", False) else None,
                       state_budget=None if args.state_budget is None else parse_bytes(args.state_budget,
                                                                                       "--state-budget"))
