"""The engine: one wrapped optimizer's state mapping, and the orchestration of one step.

A step of :class:`~optstate_core.optimizer.VirtualOptimizer` goes through here:

1. validate every gradient (:mod:`~optstate_core.step.gradients`; a rejected step leaves parameters,
   state and groups untouched), then sort each parameter onto a path;
2. the router (:mod:`~optstate_core.step.router`) sorts each parameter onto its path, the same
   way here and in the gradient-release hook; parameters whose state is all raw, device-resident
   and meant to stay so ("passthrough") are stepped by the inner optimizer in one call, on the
   real tensors: bit-identical to the unwrapped optimizer at its own speed;
3. parameters the Triton kernels can take are grouped into buckets (:mod:`~optstate_core.step.fused`)
   and handed to the step schedule (:mod:`~optstate_core.schedule.timetable`), which launches them
   (:mod:`~optstate_core.step.fused_launch`) and moves offloaded state;
4. the rest goes through the tiled reference step (:mod:`~optstate_core.step.tiled`).

Codec and tier per state come from :mod:`~optstate_core.schedule.placement`; re-storing state in the wanted
form from :mod:`~optstate_core.schedule.conform`. A plan that nothing invalidated is reused next step.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from itertools import chain, repeat
from operator import attrgetter, is_, is_not, methodcaller
from typing import Dict, Optional

import torch

from . import park
from .conform import Conformer
from .park_buffers import ParkBuffers
from ..step import passthrough_skip
from ..step.backward_check import BackwardCheck
from ..step.cpu_step import groups_still_eligible, run_cpu_plans
from .follow import follow_params, remember_params
from ..step.fused import FusedPath
from ..step.fused_launch import KernelLauncher
from ..step.gradients import all_finite, collect, split_nonfinite
from ..step.granularity import CHECKED_STEPS, check_against_whole
from ..step.inner import group_signature, run_inner
from ..step.schedule_free import advance_groups, fused_step_applies, plan_fused_step
from ..step.session import run_whole_step
from ..step.router import Router
from ..step.context import StepContext
from .placement import Placement
from .release import ClipAndRelease
from ..policy import Policy
from .timetable import StepSchedule
from ..state.pinned import PinnedArena
from ..state.store import StateMap
from ..step.tiled import TiledStep
from .transfer import Transfers
from ..step.work import StepMetrics, Work, describe_param
from ..state.master_weights import MASTER_KEY

log = logging.getLogger("optstate")

_GRAD, _DTYPE, _DEVICE, _SHAPE, _LAYOUT = (attrgetter(a) for a in ("grad", "dtype", "device", "shape", "layout"))
_CONTIGUOUS = methodcaller("is_contiguous")


def _shared(name: str) -> property:
    """An engine attribute kept in its :class:`StepContext` (read and set there)."""
    return property(lambda self: getattr(self.ctx, name), lambda self, value: setattr(self.ctx, name, value),
                    doc=f"``ctx.{name}``")


def _option(name: str) -> property:
    """A read-only engine attribute that is one of its :class:`~optstate_core.options.WrapOptions`."""
    return property(lambda self: getattr(self.options, name), doc=f"``options.{name}``")


class Engine:
    """Holds the state mapping and runs steps for one wrapped optimizer."""

    def __init__(self, inner: torch.optim.Optimizer, policy: Policy, options, names: Dict[int, str]):
        """``options``: the wrapper's validated :class:`~optstate_core.options.WrapOptions`."""
        self.inner = inner
        self.policy = policy
        # what the step paths are given (step/context.py): the state, the options (the one record:
        # the properties below read it), the step count and the metrics live there
        self.ctx = ctx = StepContext(inner, StateMap(), policy, options, names)
        self.pinned = PinnedArena(options.tuning.pinned_slab_bytes)  # offloaded state's pinned host memory
        self.transfers = Transfers()
        self.placement = Placement(policy, options.gpu_budget, options.staging_bytes, offload_all=options.offload)
        self.conformer = Conformer(self)
        self.tiled = TiledStep(ctx, self.conformer, self.transfers)
        self.fused = FusedPath(ctx, self.placement, self.pinned, options.fused)
        self.router = Router(ctx, self.conformer, self.placement, self.fused)
        self.kernels = KernelLauncher(ctx, options.stochastic_param_rounding, options.fast_math,
                                      options.tuning.launch_shapes, options.tuning.compile_ahead)
        self.schedule = StepSchedule(self, options.prefetch_budget, options.tuning.prefetch_slab_bytes)
        self.backward_check = BackwardCheck()
        self.clip_release = ClipAndRelease(self, options.release_gradients, options.max_grad_norm,
                                                options.clip_mode, options.release_bucket_bytes,
                                                options.tuning.stage_ahead)
        if options.release_gradients:
            self.schedule.release = self.clip_release
        self._plan_cache = None
        self.nonfinite_host = 0  # parameters skipped for NaN/inf gradients (reference paths)
        self._nonfinite_reported = 0
        self.own_shape_devices = {}  # (param index, key) -> device of state of its own shape, while parked
        self.park_buffers = ParkBuffers(options.tuning.pinned_slab_bytes)  # the phase switch's host buffers
        self.told_auto_wake = False  # an update woke parked state: logged once
        self.param_forms = {}  # parameter -> (dtype, device) at its last step (schedule/follow.py)

    state = property(lambda self: self.ctx.store, doc="The state mapping (``ctx.store``).")
    names = property(lambda self: self.ctx.names, doc="Parameter names by id (``ctx.names``).")
    step_count = _shared("step_count")
    metrics = _shared("metrics")
    options = _shared("options")
    chunk_bytes = _option("chunk_bytes")
    chunk_size = _option("chunk_size")
    initial_chunk_size = _option("initial_chunk_size")
    pin_memory = _option("pin_memory")
    skip_nonfinite = _option("skip_nonfinite")
    seed = _option("seed")
    granularity = _option("granularity")  # see step/granularity.py
    check_granularity = _option("check_granularity")  # the user's granularity, checked on the first steps
    check_in_backward = _option("check_in_backward")
    observe_closure_loss = _option("observe_closure_loss")

    @property
    def elementwise(self) -> bool:
        return self.options.granularity == "elementwise"

    @property
    def prefetch_during_backward(self) -> bool:
        """Whether offloaded state may upload during backward (a prefetch budget other than 0)."""
        return self.schedule.area.enabled

    @property
    def boundary(self):
        """Whether the coming backward ends in a step (see :class:`~optstate_core.schedule.timetable.StepBoundary`)."""
        return self.schedule.boundary

    def codec_of(self, w: Work, key: str):
        """The codec of state ``key`` of a parameter at this step (see :class:`Placement`)."""
        return self.placement.codec_of(w, key, self.step_count)

    def tier_of(self, w: Work, key: str) -> str:
        """The tier of state ``key`` of a parameter at this step (see :class:`Placement`)."""
        return self.placement.tier_of(w, key, self.step_count)

    # -- the parameters, as they are now ------------------------------------------------------
    def param_infos(self):
        """``(param, ParamInfo)`` for every parameter of the live groups, in checkpoint order."""
        return self.ctx.param_infos()

    def name_of(self, p) -> Optional[str]:
        """``wrap(named_parameters=...)`` first, then names the policy learned (``bind_names``)."""
        return self.ctx.name_of(p)

    def drop_nonfinite(self, works):
        """The works (or CPU plans) whose gradients are finite; the others are counted and reported."""
        kept, skipped = split_nonfinite(works, empty_shards_agree=not self.fused.kernel_device(works[0].grad))
        if skipped:
            self.nonfinite_host += len(skipped)
            log.warning("step %d: non-finite gradient (NaN, inf or |g| >= 2**64), update skipped for %s",
                        self.step_count,
                        ", ".join(describe_param(w.info) for w in skipped))
        self.metrics.nonfinite_skipped = len(skipped)
        return kept

    # -- a step --------------------------------------------------------------------------------
    def step(self) -> None:
        park.wake_for_update(self, "step()")
        t0 = time.perf_counter()
        if self.granularity == "step":
            self.metrics = StepMetrics()
            buckets = self._whole_step()
        else:
            buckets = self._plan_step()
        if buckets:
            t = time.perf_counter()
            self.schedule.run(buckets)
            self.metrics.inner_step_ms += (time.perf_counter() - t) * 1e3
        self.kernels.end_step()  # the device's step count (rounding stream) first
        self.step_count += 1
        self.schedule.end_step(self.metrics, self.transfers)  # bytes per phase; unused prefetches dropped
        if self.pinned.ahead is not None:  # the first step is over: what it did not ask for goes
            self.pinned.end_ahead()
        self.park_buffers.after_step(self)  # prepare_park() before the first step: pinning starts now
        self.metrics.total_ms = (time.perf_counter() - t0) * 1e3

    def _whole_step(self):
        """Granularity ``"step"``: schedule-free AdamW's kernel over every parameter when it applies
        (a cached plan reused while it holds), else the optimizer's own step on lent state; returns
        the buckets to launch."""
        applies = fused_step_applies(self.inner, self.fused)
        signature = self._signature() if applies else None
        cached = self._cached_plan(signature) if applies else None
        if cached is not None:
            buckets = cached[0]
        else:
            follow_params(self)
            buckets = plan_fused_step(self.ctx, self.placement, self.fused) if applies else None
            if buckets is None:
                run_whole_step(self.ctx, self.placement, self.tiled, self.drop_nonfinite, self.sync_transfers)
            remember_params(self)
            if buckets is None:
                return []
            if not any(b.first for b in buckets):
                keys = [k for b in buckets for k in b.keys]
                self._plan_cache = (signature, buckets, [], self._state_identity(keys), False, [])
        self.kernels.group_scalars = advance_groups(self.inner)
        return buckets

    def _plan_step(self):
        """Route, run the reference paths, return the fused buckets (a cached plan when it holds)."""
        if self.check_granularity and self.step_count < CHECKED_STEPS:
            self._check_granularity()
        signature = self._signature()  # parameters' dtype and device included: a cast misses the cache
        cached = self._cached_plan(signature)
        if cached is None:
            follow_params(self)  # parameters cast or moved since their last step: state follows (or a clear refusal)
        self.metrics = StepMetrics()  # (the transfer counters were reset by the last end_step: release's count too)
        if cached is None:
            buckets = self._plan_and_run(signature)
            remember_params(self)
        else:
            buckets, passthrough, on_device, cpu_plans = cached
            self._run_cpu_and_passthrough(cpu_plans, passthrough, on_device)
        return buckets

    def _check_granularity(self) -> None:
        """The granularity the user declared gives what one call over all parameters gives (on
        copies; nothing changes), or the step is refused with what differs."""
        from ..state.checkpoint import decoded_param_state
        works = collect(self.param_infos(), self.state)
        params = [w.key for w in works if w.grad.numel()]
        states = [decoded_param_state(self.state.get(p, {}), p.device, p) for p in params]
        states = [{k: v for k, v in st.items() if k != MASTER_KEY} for st in states]
        problem = check_against_whole(self.inner, self.granularity, params, states) if params else None
        if problem is not None:
            raise ValueError(f"granularity={self.granularity!r}: {type(self.inner).__name__} is not "
                             f"{self.granularity}-wise on this step: {problem} when stepped in pieces. Leave "
                             "granularity unset (one call over every parameter) or choose a coarser one")

    def _plan_and_run(self, signature):
        """Plan this step from scratch; run the reference paths; return the fused buckets."""
        works = collect(self.param_infos(), self.state)
        self.placement.assign_residency(works, self.step_count)
        routes = self.router.route(works)
        passthrough = routes.passthrough
        items = [(w.key, w.state, w.info.group_index) for w in passthrough]
        on_device = passthrough_skip.applies(self.inner, self.skip_nonfinite, items)
        self._check_in_backward([w.key for w in passthrough] if on_device and passthrough[0].key.is_cuda else [])
        items = self.run_unfused(routes, on_device)
        fused, passthrough, cpu_plans, tiled = routes.fused, routes.passthrough, routes.cpu, routes.tiled
        buckets = self.fused.build(fused) if fused else []
        cacheable = not tiled and not any(b.first for b in buckets) and all(w.state for w in passthrough) \
            and len(fused) + len(passthrough) + len(cpu_plans) == len(works)
        params = [k for b in buckets for k in b.keys] + [p for p, _, _ in items] + [c.key for c in cpu_plans]
        self._plan_cache = (signature, buckets, items, self._state_identity(params), on_device, cpu_plans) \
            if cacheable else None
        self.schedule.index_offloaded(buckets if cacheable else [])
        return buckets

    def _check_in_backward(self, params) -> None:
        """Have later steps' gradients of ``params`` (and no others) checked for NaN/inf in
        backward (:mod:`~optstate_core.step.backward_check`): only with ``check_in_backward=True`` and not
        under gradient release, whose hooks consume the gradients."""
        if not self.check_in_backward or self.clip_release.release:
            params = []
        self.backward_check.watch(params)
        self.schedule.register_hooks(params)

    def _signature(self):
        """What a cached plan depends on besides the state objects: the parameters with
        gradients, group options that change eligibility, and the policy's decisions now.
        (Per-parameter fields are gathered with ``map``: this runs before every cached step.)"""
        parts = []
        for g in self.inner.param_groups:
            ps = g["params"]
            parts.append((group_signature(g), tuple(map(id, ps)), tuple(map(is_not, map(_GRAD, ps), repeat(None))),
                          tuple(map(_DTYPE, ps)), tuple(map(_DEVICE, ps))))
        return tuple(parts), self.policy.decision_key(self.step_count), self.skip_nonfinite

    def _state_identity(self, params):
        """The cached plan's parameters, their state dicts, those dicts' values (all of them, in
        order), their shapes and dtypes (every gradient must have them too)."""
        states = [self.state.get(p) for p in params]
        return (params, states, tuple(chain.from_iterable(map(dict.values, states))), list(map(_SHAPE, params)),
                list(map(_DTYPE, params)))

    def _cached_plan(self, signature):
        """The previous step's plan (fused buckets, passthrough items) if nothing it depends on
        changed; only cheap identity checks. The full path validates and explains otherwise."""
        cache = self.__dict__.get("_plan_cache")
        if cache is None or cache[0] != signature:
            return None
        _, buckets, items, (params, states, values, shapes, dtypes), on_device, cpu_plans = cache
        now = tuple(chain.from_iterable(map(dict.values, states)))  # every state value: the very same objects
        if not all(map(is_, map(self.state.get, params), states)) or len(now) != len(values) or \
                not all(map(is_, now, values)) or list(map(_SHAPE, params)) != shapes:
            return None
        grads = list(map(_GRAD, params))
        if list(map(_SHAPE, grads)) != shapes or list(map(_DTYPE, grads)) != dtypes or \
                list(map(_LAYOUT, grads)).count(torch.strided) != len(grads) or not all(map(_CONTIGUOUS, grads)):
            return None
        if cpu_plans and not groups_still_eligible(self.inner, cpu_plans):
            return None
        checked = ([] if on_device else [p.grad for p, _, _ in items]) + [c.grad for c in cpu_plans]
        if checked and self.skip_nonfinite and not all_finite(checked):
            return None  # rare: the full path skips and reports the parameters
        self.metrics.nonfinite_skipped = 0
        return buckets, items, on_device, cpu_plans

    def run_unfused(self, routes, on_device: bool = False):
        """Step the routes' parameters that the kernels do not take, for ``step()`` and gradient
        release alike: drop those with non-finite gradients (checked on the host; the fused paths,
        and passthrough when ``on_device``, skip on the device), then the CPU fast path, the
        passthrough parameters and the tiled ones. ``routes`` keeps only what was stepped; returns
        the passthrough items ``(param, state, group index)``."""
        checked = (routes.tiled if on_device else routes.passthrough + routes.tiled) + routes.cpu
        if self.skip_nonfinite and checked:
            kept = {id(w) for w in self.drop_nonfinite(checked)}
            routes.passthrough = [w for w in routes.passthrough if on_device or id(w) in kept]
            routes.tiled = [w for w in routes.tiled if id(w) in kept]
            routes.cpu = [c for c in routes.cpu if id(c) in kept]
        items = [(w.key, w.state, w.info.group_index) for w in routes.passthrough]
        self._run_cpu_and_passthrough(routes.cpu, items, on_device)
        if routes.tiled:
            self.tiled.run(routes.tiled, update=True)
        return items

    def _run_cpu_and_passthrough(self, cpu_plans, items, on_device: bool) -> None:
        """The CPU fast path's parameters, then the passthrough ones (timed): the CPU path first,
        so a bad ``OPTSTATE_CPU_*`` setting is refused before any update."""
        run_cpu_plans(self.ctx, cpu_plans)
        if items:
            t = time.perf_counter()
            self._run_passthrough(items, on_device)
            self.metrics.inner_step_ms += (time.perf_counter() - t) * 1e3

    def _run_passthrough(self, items, on_device: bool) -> None:
        """The inner optimizer's own step on uncompressed parameters; NaN/inf skipped on the device
        when ``on_device`` (:mod:`~optstate_core.step.passthrough_skip`), else already dropped by the caller."""
        if on_device:
            passthrough_skip.run(self.inner, self.state, self.backward_check, self.kernels, items)
        else:
            run_inner(self.inner, items, self.state)

    def invalidate_plan(self) -> None:
        """Forget the cached step plan (after loading state or moving it between tiers)."""
        self._plan_cache = None
        self.schedule.index_offloaded([])
        if self.schedule.release is not None:  # gradient release keeps a bucket per parameter
            self.schedule.release.forget_buckets()

    # -- whole-state moves -----------------------------------------------------------------------
    def sync_transfers(self) -> None:
        """Wait for queued write-backs of offloaded state (before reading or replacing it)."""
        self.schedule.sync()

    @property
    def parked(self) -> bool:
        """Whether every state is parked in host memory (:mod:`~optstate_core.schedule.park`)."""
        return self.placement.force_tier == "host"

    def assign_residency(self, *, only_new: bool = False) -> None:
        """Under a GPU budget: which parameters' state stays resident, over every parameter in
        index order (``only_new``: unless assigned already). Gradient release asks before its
        first update, since its batches see a few parameters at a time."""
        if self.placement.gpu_budget is None or (only_new and self.placement.resident is not None):
            return
        works = [Work(p, info, self.state.get(p, {})) for p, info in self.param_infos()]
        self.placement.assign_residency(works, self.step_count)

    def close(self) -> None:
        """Release staging memory, streams and all state (pinned buffers included)."""
        self.schedule.close()
        self.kernels.close()
        self.invalidate_plan()
        self.state.clear()
        self.pinned.close()
        self.park_buffers.close()

    def nonfinite_skipped(self) -> int:
        """Parameters skipped for NaN/inf gradients so far (reads the fused path's device counter)."""
        device = self.kernels.nonfinite_device
        total = self.nonfinite_host + (int(device.item()) if device is not None else 0)
        if device is not None and total > self._nonfinite_reported:
            log.warning("optstate: %d parameter updates skipped for non-finite gradients so far",
                        total)
        self._nonfinite_reported = total
        return total

    def use_pinned_arena(self, arena: PinnedArena) -> None:
        """Serve offloaded state's pinned host memory from ``arena`` from now on (tests, tools)."""
        self.pinned = self.fused.pinned = arena

    def replace_options(self, **values) -> None:
        """Options changed after wrap() (validated by the caller): a new record replaces the old one."""
        self.ctx.options = dataclasses.replace(self.ctx.options, **values)

    def restore_nonfinite_count(self, count: int) -> None:
        """Set the NaN/inf skip count (from a checkpoint); the device counter starts again."""
        self.nonfinite_host = count
        self.kernels.nonfinite_device = None

    def conform(self, params=None) -> None:
        """Re-store state in the form the policy wants now (see :class:`Conformer`); parked, state
        of its own shape goes to host memory too."""
        self.conformer.conform(params)
        if self.parked:
            park.park_own_shape(self)
