"""CPU fast path: Adam/AdamW on encoded state as one decode-update-encode call per batch of row slices.

The tiled reference step (``tiled.py``) decodes a tile, runs the inner optimizer on views and
encodes the result, op by op; on a CPU the codec arithmetic (int64 rounding hash, block
scales, lookups) then dominates, many passes over memory per op. Here the same three stages
run as one function per parameter: the codecs' own ``decode_into`` / ``encode_into`` (so a
codec change flows through) around the arithmetic of ``torch.optim.Adam``'s single-tensor
step, compiled with ``torch.compile`` (inductor, C++) into a few fused loops when it can be,
else run eagerly. Compiled code is specialized per row width (:func:`slab_width`: 256-wide rows
for most weight matrices) with only the row count symbolic, so block sizes and widths are
constants of its loops. ``tuning.cpu_batch=k`` (``OPTSTATE_CPU_BATCH``) steps ``k`` row slices a
call (of one or several parameters; padded with empty ones), which shares the fixed cost of a
compiled call among small parameters at the price of a longer compilation.

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

Plans (:class:`CpuPlan`, one per parameter) are kept by the engine's cached plan, so a step that
nothing invalidated goes straight to the compiled calls. How the calls are compiled:
``cpu_compile.py``.

When it compiles: a class (codec pair, flags, row width, batch size) starts eager and is compiled
once the time it has spent eagerly reaches ``tuning.cpu_compile_after_s`` seconds (default
``DEFAULT_COMPILE_AFTER``, about what compiling one class costs here): the break-even rule, which never
spends more than about twice what the better choice in hindsight would, so a short run, an example
or a test never waits for inductor and a long run compiles early in it. Switches, wrap() options
(:class:`~optstate_core.tuning.Tuning`, defaults from the environment): ``tuning.cpu_fast_path=False``
(``OPTSTATE_CPU_FAST=0``) turns the path off; ``tuning.cpu_compile`` ``"never"`` compiles never
(``OPTSTATE_CPU_COMPILE=0``), ``"always"`` at a class's first call (``=1``), ``"auto"`` is the default.
"""
from __future__ import annotations

import logging
import time
from typing import Callable, Dict, List, Optional, Tuple

import torch

from ..state.codecs import EncodedTensor
from ..state.codecs.rounding import RoundingContext, state_seed, stream_key
from .context import Residency, StepContext
from .cpu_compile import inductor_backend, mark_sizes, note_compile, shape_config
from ..state.dtensor import is_dtensor
from .inner import decoupled_decay
from ..state.store import matches

log = logging.getLogger("optstate")

ADAM_KEYS = ("exp_avg", "exp_avg_sq")
MATERIALIZED = 8  # bytes of decoded state per element (fp32 m and v), counted against chunk_bytes
_LOGGED = set()


#: eager seconds a class runs before it is compiled in "auto" mode (``tuning.cpu_compile_after_s``): about
#: what compiling one class takes on a 2-core CPU (5-15 s), so the break-even rule never spends more
#: than about twice what the better choice in hindsight would have
DEFAULT_COMPILE_AFTER = 10.0


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
                      keys: torch.Tensor, offset: torch.Tensor, *, m_codec, v_codec, maximize: bool,
                      narrow: bool = False) -> None:
    """One Adam/AdamW step of the 2-D slab ``p`` (in place) with its two states held in the
    payloads ``m_payload`` / ``v_payload`` (decoded, updated and re-encoded in place).

    ``hyper``: :func:`adam_scalars`; ``keys``: the two states' stochastic-rounding stream keys
    this step (int64 [2]); ``offset``: the flat index of the slab's first element in the whole
    tensor (int64 0-d); ``narrow``: every element index is below 2**32 (int32 rounding
    arithmetic). The update is ``torch.optim.adam._single_tensor_adam``'s (decoupled or no
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
    m_codec.encode_into(m, m_payload, RoundingContext(keys[0], offset, cols, narrow))
    v_codec.encode_into(v, v_payload, RoundingContext(keys[1], offset, cols, narrow))


_STEPPERS: Dict[tuple, Callable] = {}
_FAILED: set = set()
_EAGER_SECONDS: Dict[tuple, float] = {}  # (flags, batch) -> seconds run eagerly so far ("auto" mode)

#: rows whose width divides by this hold whole blocks of every codec (tiled.TILE_GRANULARITY)
ROW_GRANULARITY = 256
#: distinct static widths compiled per codec pair before further widths share one dynamic-width graph
MAX_STATIC_WIDTHS = 8
#: row slices one compiled call steps unless ``tuning.cpu_batch`` says otherwise (a shorter
#: batch is padded with empty slices, so one graph per class): with more, small parameters share
#: the fixed cost of a compiled call (guards, wrappers: ~0.1 ms), but compilation takes longer
#: (~4-6 s more per slice), which pays only over thousands of steps
DEFAULT_BATCH = 1


def slab_width(cols: int) -> int:
    """The row width the step views a parameter with: ``ROW_GRANULARITY`` when the rows hold
    whole multiples of it (a row-major tensor is then a stack of 256-wide rows with the same
    blocks and the same element indices, so every such parameter shares one compiled shape
    class whatever its shape), else its own row length."""
    return ROW_GRANULARITY if cols % ROW_GRANULARITY == 0 else cols


def _stepper(m_codec, v_codec, maximize: bool, narrow: bool, width: Optional[int], compiled: bool,
             batch: int = 1) -> Callable:
    """The step for one combination of codecs and flags over ``batch`` 2-D row slices at once.
    Compiled with rows of a static ``width``: the width, block sizes and every constant are
    compiled in (inner loops with static trip counts) and only the row counts, marked by
    :func:`_mark_sizes`, are symbolic; ``width=None``: row counts and widths symbolic (one graph
    for the widths beyond ``MAX_STATIC_WIDTHS``), block sizes still constants."""
    key = (m_codec, v_codec, maximize, narrow, width, compiled, batch)
    fn = _STEPPERS.get(key)
    if fn is None:
        for codec in (m_codec, v_codec):  # fill the codecs' lookup-table caches outside the trace
            codec.encode(torch.zeros(1, codec.granularity)).decode()

        def fn(ps, gs, m_payloads, v_payloads, hyper, meta):
            for i in range(len(ps)):  # unrolled by the compiler: the batch size is part of the key
                adam_step_encoded(ps[i], gs[i], m_payloads[i], v_payloads[i], hyper[i], meta[i, :2], meta[i, 2],
                                  m_codec=m_codec, v_codec=v_codec, maximize=maximize, narrow=narrow)
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
    if group.get("weight_decay") and not decoupled_decay(inner, group):
        return "Adam with L2 weight decay (torch fuses its add into one rounding)"
    return None


def _eligible(ctx: StepContext, residency: Residency, w) -> bool:
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
        codec = residency.codec_of(w, key, ctx.step_count)
        if not matches(value, codec, residency.tier_of(w, key, ctx.step_count) == "host", p.device):
            return False
    return True


# -- the entry point -------------------------------------------------------------------------------
class _Slice:
    """One row slice of one parameter: the arguments of one ``adam_step_encoded`` call."""

    __slots__ = ("p", "g", "m", "v", "hyper", "meta", "nbytes")

    def __init__(self, p, g, m, v, hyper, meta, nbytes):
        self.p, self.g, self.m, self.v, self.hyper, self.meta, self.nbytes = p, g, m, v, hyper, meta, nbytes


class CpuPlan:
    """What this path needs of one parameter besides its gradient and the step's scalars; kept
    by the engine's cached plan, so a later step skips the eligibility checks and the views."""

    __slots__ = ("key", "param", "state", "info", "flags", "rows", "width", "rows_per_call", "m_rows", "v_rows",
                 "seeds", "offset")

    def __init__(self, ctx: StepContext, w, group, width):
        self.key, self.param, self.state, self.info = w.key, w.param, w.state, w.info
        self.width = width
        self.rows = w.rows * w.cols // width
        self.rows_per_call = max(1, ctx.options.chunk_bytes // (MATERIALIZED * width))
        m_enc, v_enc = w.state["exp_avg"], w.state["exp_avg_sq"]
        kind = (m_enc.codec, v_enc.codec, bool(group.get("maximize")), w.offset + w.rows * w.cols <= 1 << 32)
        self.flags = kind + (_class_width(kind, width),)
        self.m_rows, self.v_rows = _payload_rows(m_enc.payload, self.rows), _payload_rows(v_enc.payload, self.rows)
        self.seeds = [_seed(ctx.options.seed, w.info.index, key, enc.codec) for key, enc in zip(ADAM_KEYS, (m_enc, v_enc))]
        self.offset = w.offset

    @property
    def grad(self) -> torch.Tensor:
        return self.key.grad


def plan_cpu_fast(ctx: StepContext, residency: Residency, works: List) -> Tuple[List[CpuPlan], List]:
    """The plans of the works this path can take (Adam/AdamW, CPU, encoded state) and the rest,
    for the tiled reference path. Nothing is stepped yet."""
    if not works or not ctx.options.tuning.cpu_fast_path:
        return [], works
    inner = ctx.inner
    rest, plans = [], []
    for w in works:
        group = inner.param_groups[w.info.group_index]
        reason = _group_ok(inner, group)
        if reason is not None:
            _log_once(f"CPU fast path off: {reason}")
            rest.append(w)
            continue
        width = slab_width(w.cols)
        if not _eligible(ctx, residency, w) or MATERIALIZED * width > ctx.options.chunk_bytes:  # a row over chunk_bytes: tiled
            rest.append(w)
            continue
        plans.append(CpuPlan(ctx, w, group, width))
    return plans, rest


def groups_still_eligible(inner, plans: List[CpuPlan]) -> bool:
    """Whether the groups of cached plans still allow this path (options may change between steps)."""
    return all(_group_ok(inner, inner.param_groups[i]) is None for i in {plan.info.group_index for plan in plans})


def run_cpu_plans(ctx: StepContext, plans: List[CpuPlan]) -> None:
    """One step of the planned parameters (their gradients checked already): row slices of the
    same codecs and shape class in batches (:func:`_batches`), then each parameter's step count."""
    if not plans:
        return
    tuning = ctx.options.tuning  # validated at wrap()
    size, mode = tuning.cpu_batch, tuning.cpu_compile
    after = tuning.cpu_compile_after_s if mode == "auto" else None
    t0 = time.perf_counter()
    inner, metrics = ctx.inner, ctx.metrics
    by_class: Dict[tuple, List[_Slice]] = {}
    hypers: Dict[tuple, list] = {}  # the scalars of a group at a step count, computed once
    for plan in plans:
        group, step = inner.param_groups[plan.info.group_index], float(plan.state["step"]) + 1
        hyper = hypers.get((plan.info.group_index, step))
        if hyper is None:
            hyper = hypers[plan.info.group_index, step] = _hyper(inner, group, step)
        by_class.setdefault(plan.flags, []).extend(_slices(ctx.step_count, plan, hyper))
    with torch.no_grad(), shape_config():
        for flags, parts in by_class.items():
            run = _Runner(flags, size, mode, after)
            for batch in _batches(parts, ctx.options.chunk_bytes, size):
                run(batch)
                metrics.peak_materialized_bytes = max(metrics.peak_materialized_bytes, sum(s.nbytes for s in batch))
            metrics.chunks += len(parts)
            metrics.tiles += len(parts)
    for plan in plans:
        plan.state["step"] += 1  # in place, as torch's Adam (the cached plan holds the state's objects)
    metrics.inner_step_ms += (time.perf_counter() - t0) * 1e3


def _hyper(inner, group, step: float) -> List[float]:
    beta1, beta2 = group["betas"]
    return adam_scalars(float(group["lr"]), float(beta1), float(beta2), float(group["eps"]),
                        float(group["weight_decay"]), step, decoupled_decay(inner, group))


def _slices(step: int, plan: CpuPlan, hyper: List[float]) -> List[_Slice]:
    """The row slices of one parameter this step, each slice's decoded state (m and v in fp32,
    ``MATERIALIZED`` bytes per element) under ``chunk_bytes``."""
    width, rows, per_call = plan.width, plan.rows, plan.rows_per_call
    keys = [0 if seed is None else stream_key(seed, step) for seed in plan.seeds]
    p, g = plan.param.detach().view(rows, width), plan.key.grad.detach().view(rows, width)
    if rows <= per_call:  # the whole parameter in one slice (the common case)
        return [_Slice(p, g, plan.m_rows, plan.v_rows, hyper, keys + [plan.offset], rows * MATERIALIZED * width)]
    parts = []
    for r0 in range(0, rows, per_call):
        r1 = min(rows, r0 + per_call)
        parts.append(_Slice(p[r0:r1], g[r0:r1], {k: t[r0:r1] for k, t in plan.m_rows.items()},
                            {k: t[r0:r1] for k, t in plan.v_rows.items()}, hyper, keys + [plan.offset + r0 * width],
                            (r1 - r0) * MATERIALIZED * width))
    return parts


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


def _compile_now(flags, size: int, mode: str, after: Optional[float]) -> bool:
    """Whether this class runs compiled now: never after a failed compilation; in "auto" mode once
    its eager time has reached ``after`` seconds (``tuning.cpu_compile_after_s``), or it is compiled already."""
    if mode == "never" or flags in _FAILED:
        return False
    if mode == "always" or (*flags, True, size) in _STEPPERS:
        return True
    return _EAGER_SECONDS.get((flags, size), 0.0) >= after


class _Runner:
    """Runs the batches of one class (``flags``: m codec, v codec, maximize, narrow, row width or None):
    compiled, each batch padded to ``size`` slices, when :func:`_compile_now` says so and compilation
    works, else eagerly (timed, for "auto" mode). Looks its steppers up once per class, not per call."""

    def __init__(self, flags, size: int, mode: str, after: Optional[float]):
        self.flags, self.size = flags, size
        self.compiled = _compile_now(flags, size, mode, after)
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
                self.fn(*mark_sizes(args, self.flags[-1] is None))
                note_compile(self.flags, self.size, time.perf_counter() - t)
                return
            except Exception as e:  # dynamo/inductor unavailable or failing, before any write: eager
                _FAILED.add(self.flags)
                self.compiled = False
                log.warning("optstate: CPU fast path runs eagerly for %s/%s; torch.compile failed: %s",
                            self.flags[0].name, self.flags[1].name, e)
            args = tuple(a[:n] for a in args)  # without the padding
        t = time.perf_counter()
        _stepper(*self.flags, compiled=False, batch=n)(*args)
        key = (self.flags, self.size)
        _EAGER_SECONDS[key] = _EAGER_SECONDS.get(key, 0.0) + time.perf_counter() - t


def _padding(like: _Slice) -> _Slice:
    """A slice of no rows shaped like ``like`` (its own empty tensors: no aliasing between inputs)."""
    def empty(t):
        return torch.empty((0,) + tuple(t.shape[1:]), dtype=t.dtype)
    return _Slice(empty(like.p), empty(like.g), {k: empty(t) for k, t in like.m.items()},
                  {k: empty(t) for k, t in like.v.items()}, like.hyper, like.meta, 0)


_STATIC_WIDTHS: Dict[tuple, set] = {}


def _class_width(kind: tuple, width: int) -> Optional[int]:
    """The row width as a constant of the compiled code (the common case), or None once this
    ``kind`` (codec pair, maximize, narrow) has ``MAX_STATIC_WIDTHS`` others (odd widths then share one
    graph instead of compiling each)."""
    seen = _STATIC_WIDTHS.setdefault(kind, set())
    if width in seen or width == ROW_GRANULARITY or len(seen) < MAX_STATIC_WIDTHS:
        seen.add(width)
        return width
    return None


def _seed(seed: int, index: int, key: str, codec) -> Optional[int]:
    """The rounding stream seed of one state (None: the codec rounds to nearest)."""
    return state_seed(seed, index, key) if codec.stochastic_rounding else None
