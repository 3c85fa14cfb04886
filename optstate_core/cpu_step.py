"""CPU fast path: Adam/AdamW on encoded state as one decode-update-encode call per batch of row slices.

The tiled reference step (``tiled.py``) decodes a tile, runs the inner optimizer on views and
encodes the result, op by op; on a CPU the codec arithmetic (int64 rounding hash, block
scales, lookups) then dominates, many passes over memory per op. Here the same three stages
run as one function per parameter: the codecs' own ``decode_into`` / ``encode_into`` (so a
codec change flows through) around the arithmetic of ``torch.optim.Adam``'s single-tensor
step, compiled with ``torch.compile`` (inductor, C++) into a few fused loops when it can be,
else run eagerly. Compiled code is specialized per row width (:func:`slab_width`: 256-wide rows
for most weight matrices) with only the row count symbolic, so block sizes and widths are
constants of its loops. ``OPTSTATE_CPU_BATCH=k`` steps ``k`` row slices a call (of one or several
parameters; padded with empty ones), which shares the fixed cost of a compiled call among small
parameters at the price of a longer compilation.

Results: eager execution performs the same torch operations on the same float32 values as
the reference, so it is bit-identical to it. Compiled code rounds a few float operations
differently (inductor lowers lerp/addcmul without torch's fused multiply-add and divides by a
scalar through its reciprocal: a few ulp on the updated values); stochastic-rounding bits are the same integer
stream, so a code differs only where the value before encoding sits within those ulp of a
rounding threshold. ``tests/test_cpu_step.py`` states and checks the bound.

Which parameters: ``torch.optim.Adam``/``AdamW`` (decoupled or no weight decay; not amsgrad,
fused, capturable or differentiable; float ``lr`` and betas), a contiguous float32 CPU parameter and gradient that are not
DTensors, and every tensor state already encoded with the codec the policy picks now (the
first step, a codec switch and everything else go through the tiled reference path).

Switches: ``OPTSTATE_CPU_FAST=0`` turns the path off; ``OPTSTATE_CPU_COMPILE=0`` runs it
eagerly (the test suite does, except for the tests of the compiled path).
"""
from __future__ import annotations

import logging
import os
import time
from typing import Callable, Dict, List, Optional

import torch

from .codecs import EncodedTensor
from .codecs.rounding import RoundingContext, state_seed, stream_key
from .dtensor import is_dtensor
from .store import matches

log = logging.getLogger("optstate")

ADAM_KEYS = ("exp_avg", "exp_avg_sq")
MATERIALIZED = 8  # bytes of decoded state per element (fp32 m and v), counted against chunk_bytes
_LOGGED = set()


def enabled() -> bool:
    return os.environ.get("OPTSTATE_CPU_FAST", "1") != "0"


def compile_wanted() -> bool:
    return os.environ.get("OPTSTATE_CPU_COMPILE", "1") != "0"


def _log_once(reason: str) -> None:
    if reason not in _LOGGED:
        _LOGGED.add(reason)
        log.info("optstate: %s", reason)


# -- the step of one parameter ---------------------------------------------------------------
#: slots of the ``hyper`` tensor: float32 values of the scalars torch's step computes in double
DECAY, LERP_WEIGHT, BETA2, ONE_MINUS_BETA2, BC2_SQRT, EPS, NEG_STEP_SIZE = range(7)


def adam_scalars(lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: float,
                 decoupled: bool) -> List[float]:
    """The scalars of ``_single_tensor_adam`` at this step, computed as torch computes them
    (Python floats); a row of the ``hyper`` tensor, which rounds them to float32 as torch's CPU
    kernels round them."""
    bias_correction1 = 1 - beta1 ** step
    bias_correction2 = 1 - beta2 ** step
    decay = 1 - lr * weight_decay if decoupled else 1.0
    return [decay, 1 - beta1, beta2, 1 - beta2, bias_correction2 ** 0.5, eps, -(lr / bias_correction1)]


def adam_step_encoded(p: torch.Tensor, g: torch.Tensor, m_payload: dict, v_payload: dict, hyper: torch.Tensor,
                      keys: torch.Tensor, offset: torch.Tensor, *, m_codec, v_codec, maximize: bool) -> None:
    """One Adam/AdamW step of the 2-D slab ``p`` (in place) with its two states held in the
    payloads ``m_payload`` / ``v_payload`` (decoded, updated and re-encoded in place).

    ``hyper``: :func:`adam_scalars`; ``keys``: the two states' stochastic-rounding stream keys
    this step (int64 [2]); ``offset``: the flat index of the slab's first element in the whole
    tensor (int64 0-d). The update is ``torch.optim.adam._single_tensor_adam``'s (decoupled or no
    weight decay), operation for operation: each scalar multiplies the same operand, and
    ``addcmul``/``addcdiv`` keep torch's CPU evaluation order (``fma(value * t1, t2, self)``,
    ``self + value * t1 / t2``).
    """
    rows, cols = p.shape
    m = m_codec.decode_into(m_payload, torch.empty_like(p))
    v = v_codec.decode_into(v_payload, torch.empty_like(p))
    if maximize:
        g = -g
    p.mul_(hyper[DECAY])
    m.lerp_(g, hyper[LERP_WEIGHT])
    v.mul_(hyper[BETA2]).addcmul_(hyper[ONE_MINUS_BETA2] * g, g)
    denom = (v.sqrt() / hyper[BC2_SQRT]).add_(hyper[EPS])
    p.addcdiv_(hyper[NEG_STEP_SIZE] * m, denom)
    m_codec.encode_into(m, m_payload, RoundingContext(keys[0], offset, cols))
    v_codec.encode_into(v, v_payload, RoundingContext(keys[1], offset, cols))


def bucketize_by_counting(input, boundaries, *, out_int32=False, right=False):
    """``aten.bucketize`` for sorted ``boundaries`` as a count of comparisons (inductor's C++
    backend has no bucketize and would call the eager kernel between its fused loops): the
    index is the number of boundaries below the value (at or below it with ``right``), NaN last.
    A short table (a codebook) is unrolled into elementwise compares, which vectorize."""
    n = int(boundaries.shape[0])  # specializes the table's length: one guard
    if n <= UNROLL_BOUNDARIES:
        count = torch.zeros_like(input, dtype=torch.int32)  # int32 vectors hold twice the lanes
        for i in range(n):
            count = count + ((boundaries[i] <= input) if right else (boundaries[i] < input)).to(torch.int32)
    else:
        count = ((boundaries <= input.unsqueeze(-1)) if right else (boundaries < input.unsqueeze(-1))).sum(-1)
    index = torch.where(input != input, n, count)  # NaN (a comparison vectorizes where isnan does not)
    return index.to(torch.int32 if out_int32 else torch.int64)


UNROLL_BOUNDARIES = 64


#: codes index lookup tables that always hold 2**bits entries: no per-element bounds check
INDUCTOR_PATCHES = {"assert_indirect_indexing": False}


def inductor_backend(gm, example_inputs):
    """inductor, with bucketize decomposed into comparisons (so the 4-bit encode fuses too)."""
    from torch._inductor.compile_fx import compile_fx
    from torch._inductor.decomposition import select_decomp_table
    table = dict(select_decomp_table())
    table[torch.ops.aten.bucketize.Tensor] = bucketize_by_counting
    return compile_fx(gm, example_inputs, decompositions=table, config_patches=INDUCTOR_PATCHES)


_STEPPERS: Dict[tuple, Callable] = {}
_FAILED: set = set()

#: rows whose width divides by this hold whole blocks of every codec (tiled.TILE_GRANULARITY)
ROW_GRANULARITY = 256
#: distinct static widths compiled per codec pair before further widths share one dynamic-width graph
MAX_STATIC_WIDTHS = 8
#: row slices one compiled call steps unless ``OPTSTATE_CPU_BATCH`` says otherwise (a shorter
#: batch is padded with empty slices, so one graph per class): with more, small parameters share
#: the fixed cost of a compiled call (guards, wrappers: ~0.1 ms), but compilation takes longer
#: (~4-6 s more per slice), which pays only over thousands of steps
DEFAULT_BATCH = 1


def batch_size() -> int:
    """Slices per compiled call: ``OPTSTATE_CPU_BATCH``, else ``DEFAULT_BATCH``."""
    value = os.environ.get("OPTSTATE_CPU_BATCH")
    if value is None:
        return DEFAULT_BATCH
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"OPTSTATE_CPU_BATCH must be a positive integer, got {value!r}")
    return int(value)


def slab_width(cols: int) -> int:
    """The row width the step views a parameter with: ``ROW_GRANULARITY`` when the rows hold
    whole multiples of it (a row-major tensor is then a stack of 256-wide rows with the same
    blocks and the same element indices, so every such parameter shares one compiled shape
    class whatever its shape), else its own row length."""
    return ROW_GRANULARITY if cols % ROW_GRANULARITY == 0 else cols


def _stepper(m_codec, v_codec, maximize: bool, width: Optional[int], compiled: bool, batch: int = 1) -> Callable:
    """The step for one combination of codecs and flags over ``batch`` 2-D row slices at once.
    Compiled with rows of a static ``width``: the width, block sizes and every constant are
    compiled in (inner loops with static trip counts) and only the row counts, marked by
    :func:`_mark_sizes`, are symbolic; ``width=None``: row counts and widths symbolic (one graph
    for the widths beyond ``MAX_STATIC_WIDTHS``), block sizes still constants."""
    key = (m_codec, v_codec, maximize, width, compiled, batch)
    fn = _STEPPERS.get(key)
    if fn is None:
        for codec in (m_codec, v_codec):  # fill the codecs' lookup-table caches outside the trace
            codec.encode(torch.zeros(1, codec.granularity)).decode()

        def fn(ps, gs, m_payloads, v_payloads, hyper, meta):
            for i in range(len(ps)):  # unrolled by the compiler: the batch size is part of the key
                adam_step_encoded(ps[i], gs[i], m_payloads[i], v_payloads[i], hyper[i], meta[i, :2], meta[i, 2],
                                  m_codec=m_codec, v_codec=v_codec, maximize=maximize)
        # a code object of its own: dynamo keeps its graphs per code object and its recompile
        # limit (8) would otherwise count every codec pair, width and batch size of the process together
        fn.__code__ = fn.__code__.replace(co_name=f"optstate_cpu_step_{len(_STEPPERS)}")
        if compiled:  # static by default: Python ints (block sizes, width) are compiled in
            fn = torch.compile(fn, backend=inductor_backend, dynamic=False, fullgraph=True)
        _STEPPERS[key] = fn
    return fn


# -- which parameters ---------------------------------------------------------------------------
def _group_ok(inner: torch.optim.Optimizer, group: dict) -> Optional[str]:
    if type(inner) not in (torch.optim.Adam, torch.optim.AdamW):
        return f"{type(inner).__name__} has no CPU fast path"
    for flag in ("amsgrad", "capturable", "differentiable", "fused"):
        if group.get(flag):
            return f"{flag}=True"
    if isinstance(group.get("lr"), torch.Tensor) or any(isinstance(b, torch.Tensor) for b in group["betas"]):
        return "tensor lr/betas"
    if group.get("weight_decay") and not _decoupled(inner, group):
        return "Adam with L2 weight decay (torch fuses its add into one rounding)"
    return None


def _eligible(engine, w) -> bool:
    p, g = w.param, w.grad
    if p.device.type != "cpu" or p.dtype != torch.float32 or g is None or g.dtype != torch.float32:
        return False
    if is_dtensor(w.key) or not p.is_contiguous() or not g.is_contiguous() or p.is_complex():
        return False
    if set(w.state) != {"step", *ADAM_KEYS} or not isinstance(w.state["step"], torch.Tensor):
        return False
    for key in ADAM_KEYS:
        value = w.state[key]
        if not isinstance(value, EncodedTensor) or value.shape != p.shape or not value.payload_contiguous():
            return False
        codec = engine.codec_of(w, key)
        if not matches(value, codec, engine.tier_of(w, key) == "host", p.device):
            return False
    return True


# -- the entry point -------------------------------------------------------------------------------
class _Slice:
    """One row slice of one parameter: the arguments of one ``adam_step_encoded`` call."""

    __slots__ = ("p", "g", "m", "v", "hyper", "meta", "nbytes")

    def __init__(self, p, g, m, v, hyper, meta, nbytes):
        self.p, self.g, self.m, self.v, self.hyper, self.meta, self.nbytes = p, g, m, v, hyper, meta, nbytes


def run_cpu_fast(engine, works: List) -> List:
    """Step the works this path can take (Adam/AdamW, CPU, encoded state); return the rest for
    the tiled reference path. Called by the engine after non-finite gradients were dropped.
    Row slices of the same codecs and shape class are stepped in batches (:func:`_batches`)."""
    if not works or not enabled():
        return works
    inner = engine.inner
    rest, done = [], []
    by_class: Dict[tuple, List[_Slice]] = {}
    t0 = time.perf_counter()
    for w in works:
        group = inner.param_groups[w.info.group_index]
        reason = _group_ok(inner, group)
        if reason is not None:
            _log_once(f"CPU fast path off: {reason}")
            rest.append(w)
            continue
        slices = _slices(engine, w, group) if _eligible(engine, w) else None
        if slices is None:
            rest.append(w)
            continue
        flags, parts = slices
        by_class.setdefault(flags, []).extend(parts)
        done.append(w)
    if not done:
        return rest
    metrics = engine.metrics
    with torch.no_grad(), _shape_config():
        size = batch_size()
        for flags, parts in by_class.items():
            run = _Runner(flags, size)
            for batch in _batches(parts, engine.chunk_bytes, size):
                run(batch)
                metrics.peak_materialized_bytes = max(metrics.peak_materialized_bytes, sum(s.nbytes for s in batch))
            metrics.chunks += len(parts)
            metrics.tiles += len(parts)
    for w in done:
        new_step = w.state["step"].clone()
        new_step += 1
        w.state["step"] = new_step
        engine.state[w.key] = w.state
    metrics.inner_step_ms += (time.perf_counter() - t0) * 1e3
    return rest


def _slices(engine, w, group):
    """``(flags, row slices)`` of one parameter, each slice's decoded state (m and v in fp32,
    ``MATERIALIZED`` bytes per element) under ``chunk_bytes``; None (the tiled path) when one
    row exceeds it. ``flags``: (m codec, v codec, maximize, row width of the compiled class)."""
    width = slab_width(w.cols)
    per_row = MATERIALIZED * width
    if per_row > engine.chunk_bytes:
        return None
    rows = w.rows * w.cols // width
    rows_per_call = max(1, engine.chunk_bytes // per_row)
    m_enc, v_enc = w.state["exp_avg"], w.state["exp_avg_sq"]
    beta1, beta2 = group["betas"]
    hyper = adam_scalars(float(group["lr"]), float(beta1), float(beta2), float(group["eps"]),
                         float(group["weight_decay"]), float(w.state["step"]) + 1, _decoupled(engine.inner, group))
    keys = [_key(engine, w, "exp_avg", m_enc.codec), _key(engine, w, "exp_avg_sq", v_enc.codec)]
    kind = (m_enc.codec, v_enc.codec, bool(group.get("maximize")))
    flags = kind + (_class_width(kind, width),)
    p, g = w.param.detach().view(rows, width), w.grad.detach().view(rows, width)
    m_rows, v_rows = _payload_rows(m_enc.payload, rows), _payload_rows(v_enc.payload, rows)
    parts = []
    for r0 in range(0, rows, rows_per_call):
        r1 = min(rows, r0 + rows_per_call)
        parts.append(_Slice(p[r0:r1], g[r0:r1], {k: t[r0:r1] for k, t in m_rows.items()},
                            {k: t[r0:r1] for k, t in v_rows.items()}, hyper, keys + [w.offset + r0 * width],
                            (r1 - r0) * per_row))
    return flags, parts


def _batches(parts: List[_Slice], chunk_bytes: int, size: int):
    """Consecutive slices in batches of up to ``size`` whose decoded state together stays under
    ``chunk_bytes`` (a slice at the limit goes alone)."""
    i = 0
    while i < len(parts):
        n, total = 0, 0
        while i + n < len(parts) and n < size and (n == 0 or total + parts[i + n].nbytes <= chunk_bytes):
            total += parts[i + n].nbytes
            n += 1
        yield parts[i:i + n]
        i += n


def _payload_rows(payload: dict, rows: int) -> dict:
    """The (contiguous) payload tensors viewed as ``rows`` rows (of whole blocks)."""
    return {k: t.view(rows, -1) for k, t in payload.items()}


class _Runner:
    """Runs the batches of one class (``flags``: m codec, v codec, maximize, row width or None):
    compiled, each batch padded to ``size`` slices, while compilation is wanted and works, else
    eagerly. Looks its steppers up once per class, not per call."""

    def __init__(self, flags, size: int):
        self.flags, self.size = flags, size
        self.compiled = compile_wanted() and flags not in _FAILED
        self.fn = _stepper(*flags, compiled=True, batch=size) if self.compiled else None
        self.pads: List[_Slice] = []  # distinct empty slices for short batches, built once

    def __call__(self, batch: List[_Slice]) -> None:
        n = len(batch)
        if self.compiled and n < self.size:
            # distinct tensors: the same one twice would be an aliased input, and each number of
            # repeats a graph of its own
            self.pads += [_padding(batch[0]) for _ in range(self.size - n - len(self.pads))]
            batch = batch + self.pads[:self.size - n]
        args = ([s.p for s in batch], [s.g for s in batch], [s.m for s in batch], [s.v for s in batch],
                torch.tensor([s.hyper for s in batch], dtype=torch.float32),
                torch.tensor([s.meta for s in batch], dtype=torch.int64))
        if self.compiled:
            try:
                t = time.perf_counter()
                self.fn(*_mark_sizes(args, self.flags[3] is None))
                _note_compile(self.flags, self.size, time.perf_counter() - t)
                return
            except Exception as e:  # dynamo/inductor unavailable or failing, before any write: eager
                _FAILED.add(self.flags)
                self.compiled = False
                log.warning("optstate: CPU fast path runs eagerly for %s/%s; torch.compile failed: %s",
                            self.flags[0].name, self.flags[1].name, e)
            args = tuple(a[:n] for a in args)  # without the padding
        _stepper(*self.flags, compiled=False, batch=n)(*args)


def _padding(like: _Slice) -> _Slice:
    """A slice of no rows shaped like ``like`` (its own empty tensors: no aliasing between inputs)."""
    def empty(t):
        return torch.empty((0,) + tuple(t.shape[1:]), dtype=t.dtype)
    return _Slice(empty(like.p), empty(like.g), {k: empty(t) for k, t in like.m.items()},
                  {k: empty(t) for k, t in like.v.items()}, like.hyper, like.meta, 0)


_STATIC_WIDTHS: Dict[tuple, set] = {}


def _class_width(kind: tuple, width: int) -> Optional[int]:
    """The row width as a constant of the compiled code (the common case), or None once this
    ``kind`` (codec pair, maximize) has ``MAX_STATIC_WIDTHS`` others (odd widths then share one
    graph instead of compiling each)."""
    seen = _STATIC_WIDTHS.setdefault(kind, set())
    if width in seen or width == ROW_GRANULARITY or len(seen) < MAX_STATIC_WIDTHS:
        seen.add(width)
        return width
    return None


def _mark_sizes(args, widths_too: bool):
    """Mark the row count (and with ``widths_too`` the width) of every 2-D argument symbolic
    for the compiler: one graph for any number of rows (and any width)."""
    ps, gs, m_payloads, v_payloads = args[:4]
    tensors = [*ps, *gs, *(t for d in m_payloads for t in d.values()), *(t for d in v_payloads for t in d.values())]
    for t in tensors:
        for dim in ((0, 1) if widths_too else (0,)):
            torch._dynamo.maybe_mark_dynamic(t, dim)
    return args


def _shape_config():
    """Trace sizes symbolically, 1 included, and never equate unrelated sizes (a lookup table's
    length with a row count): a handful of graphs per codec pair instead of one per shape."""
    return torch.fx.experimental._config.patch(backed_size_oblivious=True, use_duck_shape=False)


def _decoupled(inner, group) -> bool:
    return bool(group.get("decoupled_weight_decay", isinstance(inner, torch.optim.AdamW)))


_COMPILE_SECONDS: Dict[tuple, float] = {}


def _note_compile(flags, batch: int, seconds: float) -> None:
    """Log the first (compiling) call of each combination and batch size."""
    if (flags, batch) not in _COMPILE_SECONDS:
        _COMPILE_SECONDS[flags, batch] = seconds
        width = "any width" if flags[3] is None else f"rows of {flags[3]}"
        log.info("optstate: CPU fast path compiled for %s/%s, %s, %d slice(s) a call, in %.1f s",
                 flags[0].name, flags[1].name, width, batch, seconds)


def _key(engine, w, key: str, codec) -> int:
    if not codec.stochastic_rounding:
        return 0
    return stream_key(state_seed(engine.seed, w.info.index, key), engine.step_count)
