"""The wrapped optimizer's view of its state during one call of its own: a whole step, or any other
public method it has (schedule-free's ``train()``/``eval()``, and methods we have never heard of).

During the call ``inner.state`` is a :class:`StateSession`: a parameter's state is decoded when the
optimizer first reads it (raw device tensors are lent as they are, so in-place updates land) and
written back when the call ends, encoded as the policy says; a value the call did not change (the
same object, its version counter unmoved) keeps its stored words. Parameters that keep master
weights appear in the groups as their fp32 masters for the call and are rounded back afterwards,
so the optimizer works on the master exactly as the reference path does. Its groups are the real
group dicts: what it writes there persists.
"""
from __future__ import annotations

import inspect
import logging
import time
from collections.abc import MutableMapping

import torch

from ..state import master_weights
from ..state.master_weights import MASTER_KEY
from ..state.store import ParamState
from .gradients import collect
from .inner import unhooked_step
from .context import Residency, StepContext
from .tiled import TiledStep, _materialized_bytes
from .work import Tile, Work

log = logging.getLogger("optstate")


class _Opened:
    """One parameter's state as lent to the optimizer, and what it was when lent."""

    __slots__ = ("work", "tile", "originals", "master_version")

    def __init__(self, work: Work, tile: Tile):
        self.work, self.tile = work, tile
        self.originals = {k: (v, v._version if isinstance(v, torch.Tensor) else None) for k, v in tile.states.items()}
        self.master_version = None

    def unchanged(self, key, value) -> bool:
        original = self.originals.get(key)
        return original is not None and original[0] is value and (
            not isinstance(value, torch.Tensor) or value._version == original[1])


class StateSession(MutableMapping):
    """``inner.state`` during one call: decoded on access, committed by :meth:`commit`."""

    def __init__(self, ctx: StepContext, tiled: TiledStep, update: bool):
        self.ctx, self.tiled = ctx, tiled
        self.store = ctx.store
        self.update = update  # a step (stochastic rounding stream, seeds consumed) or another method
        self.infos = {id(p): (p, info) for p, info in ctx.param_infos()}
        self.alias = {}  # id(tensor the optimizer sees) -> the parameter (masters)
        self.opened = {}  # id(parameter) -> _Opened
        self.saved_params = []

    # -- the mapping the optimizer sees -------------------------------------------------------------
    def _param(self, key):
        return self.alias.get(id(key), key)

    def _is_param(self, key) -> bool:
        return isinstance(key, torch.Tensor) and id(self._param(key)) in self.infos

    def __getitem__(self, key):
        if not self._is_param(key):
            return self.store[key]
        return self._open(self._param(key)).tile.states

    def __setitem__(self, key, value) -> None:
        if not self._is_param(key):
            self.store[key] = value
            return
        self._open(self._param(key)).tile.states = value

    def __delitem__(self, key) -> None:
        if not self._is_param(key):
            del self.store[key]
            return
        self._open(self._param(key)).tile.states = {}

    def __contains__(self, key) -> bool:
        p = self._param(key)
        return (self._is_param(key) and id(p) in self.opened) or p in self.store

    def __iter__(self):
        seen = set()
        for p in list(self.store):
            seen.add(id(p))
            yield p
        for o in list(self.opened.values()):
            if id(o.work.key) not in seen:
                yield o.work.key

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def get(self, key, default=None):
        return self[key] if key in self else default

    # -- lending and committing ---------------------------------------------------------------------
    def _open(self, p) -> _Opened:
        opened = self.opened.get(id(p))
        if opened is not None:
            return opened
        _, info = self.infos[id(p)]
        work = Work(p, info, self.store[p] if p in self.store else ParamState())
        tile = Tile(work, 0, work.param.numel(), 0, work.rows, 0, work.cols, whole=True)
        self.tiled.materialize(tile)
        opened = self.opened[id(p)] = _Opened(work, tile)
        return opened

    def open_masters(self) -> None:
        """Put each master-weight parameter's fp32 master in its group for the call."""
        for group in self.ctx.inner.param_groups:
            params = group["params"]
            self.saved_params.append((group, params))
            swapped = list(params)
            for j, p in enumerate(params):
                if self.ctx.policy.master_codec(self.infos[id(p)][1]) is None:
                    continue
                opened = self._open(p)
                master_weights.open_tile(opened.tile)
                opened.master_version = opened.tile.tensor._version
                self.alias[id(opened.tile.tensor)] = p
                swapped[j] = opened.tile.tensor
            group["params"] = swapped

    def restore_groups(self) -> None:
        for group, params in self.saved_params:
            group["params"] = params
        self.saved_params = []

    def commit(self) -> int:
        """Write back what the call changed; returns the decoded bytes that were alive."""
        materialized = 0
        for opened in self.opened.values():
            tile, work = opened.tile, opened.work
            if tile.master is not None:
                if tile.tensor._version != opened.master_version:
                    master_weights.close_tile(tile)
                else:  # the master did not move: the parameter and its stored correction stand
                    tile.tensor, tile.master = tile.master, None
            materialized += _materialized_bytes(tile)
            for key in [k for k in opened.originals if k not in tile.states and k != MASTER_KEY]:
                work.state.pop(key, None)  # the optimizer deleted it
            tile.states = {k: v for k, v in tile.states.items() if not opened.unchanged(k, v)}
            if not tile.states and work.key in self.store:
                continue
            work.tiles_left = 1
            self.tiled.commit(tile, update=True)
            if self.update:
                master_weights.forget_seed(work.key)
        self.opened = {}
        return materialized


def _lend(inner, sync, session: StateSession, call):
    """Run ``call()`` with ``session`` as the optimizer's state and its masters in the groups
    (``sync()`` first: write-backs of offloaded state land before anything is decoded)."""
    sync()
    saved = inner.state
    try:
        session.open_masters()
        inner.state = session
        result = call()
    finally:
        inner.state = saved
        session.restore_groups()
    return result


def run_whole_step(ctx: StepContext, residency: Residency, tiled: TiledStep, drop_nonfinite, sync) -> None:
    """One call of the optimizer's own ``step`` over every parameter (granularity ``"step"``):
    validate every gradient first, leave out those with NaN/inf (``skip_nonfinite``;
    ``drop_nonfinite(works)`` keeps the finite ones and reports the others), lend the decoded
    state, commit it."""
    works = collect(ctx.param_infos(), ctx.store)
    residency.assign_residency(works, ctx.step_count)
    hidden = []
    if ctx.options.skip_nonfinite and works:
        kept = {id(w) for w in drop_nonfinite(works)}
        hidden = [(w.key, w.key.grad) for w in works if id(w) not in kept]
    t0 = time.perf_counter()
    session, inner = StateSession(ctx, tiled, update=True), ctx.inner
    try:
        for p, _ in hidden:
            p.grad = None
        _lend(inner, sync, session, lambda: unhooked_step(inner)(inner))
    finally:
        for p, grad in hidden:
            p.grad = grad
    t1 = time.perf_counter()
    materialized = session.commit()
    metrics = ctx.metrics
    metrics.peak_materialized_bytes = max(metrics.peak_materialized_bytes, materialized)
    metrics.inner_step_ms += (t1 - t0) * 1e3
    metrics.commit_ms += (time.perf_counter() - t1) * 1e3
    metrics.tiles += len(works)
    metrics.chunks += 1


class SessionMethod:
    """One public method of the wrapped optimizer, run with its state lent (see the module doc).
    Installed on the optimizer instance, so a call on the optimizer itself goes through it too; a
    call from inside another call (the state is lent already) runs as it is."""

    def __init__(self, ctx: StepContext, tiled: TiledStep, sync, name: str):
        self.ctx, self.tiled, self.sync, self.name = ctx, tiled, sync, name

    def __call__(self, *args, **kwargs):
        inner = self.ctx.inner
        fn = getattr(type(inner), self.name)
        if inner.state is not self.ctx.store:  # inside a step or another method already
            return fn(inner, *args, **kwargs)
        session = StateSession(self.ctx, self.tiled, update=False)
        with torch.no_grad():
            result = _lend(inner, self.sync, session, lambda: fn(inner, *args, **kwargs))
            session.commit()
        return result

    def __repr__(self) -> str:
        return f"<optstate session method {type(self.ctx.inner).__name__}.{self.name}>"


def public_methods(optimizer: torch.optim.Optimizer):
    """Names of the public methods the optimizer's classes add to ``torch.optim.Optimizer`` (those a
    framework or a user may call between steps: ``train``, ``eval``, ...); ``step`` excluded."""
    base = set(dir(torch.optim.Optimizer))
    names = []
    for cls in type(optimizer).__mro__:
        if cls is torch.optim.Optimizer or not issubclass(cls, torch.optim.Optimizer):
            continue
        for name, attr in vars(cls).items():
            if not name.startswith("_") and name not in base and inspect.isfunction(attr) and name not in names:
                names.append(name)
    return names


def install_session_methods(ctx: StepContext, tiled: TiledStep, sync) -> list:
    """Route the optimizer's own public methods through :class:`SessionMethod` (``sync()``: wait
    for write-backs of offloaded state); returns their names."""
    inner = ctx.inner
    names = public_methods(inner)
    for name in names:
        inner.__dict__[name] = SessionMethod(ctx, tiled, sync, name)
    if names:
        log.debug("optstate: %s's methods %s see their decoded state", type(inner).__name__, names)
    return names
