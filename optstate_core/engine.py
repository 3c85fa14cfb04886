"""The chunked step: materialize a chunk's state, run the inner optimizer on it, commit it.

One step of :class:`~optstate_core.optimizer.VirtualOptimizer` goes through here:

1. ``collect``: every parameter with a gradient, validated before anything changes (a rejected
   step leaves parameters, state and groups untouched); optionally drop parameters whose
   gradient holds NaN/inf (one host synchronisation for the whole step).
2. Parameters whose state is all raw, device-resident and meant to stay so ("passthrough")
   are stepped by the inner optimizer in one call, on the real tensors: bit-identical to the
   unwrapped optimizer at its own speed.
3. The rest is cut into *tiles* (flat element ranges that start on a block boundary; a whole
   parameter when the optimizer is not elementwise) and packed into chunks of bounded bytes.
   Per chunk: decode each tile's state into fresh buffers, run the inner optimizer on views of
   the parameters and gradients, encode the result back with the codec the policy picks now.
   Tile boundaries never change results (every supported update is elementwise and stochastic
   rounding is keyed by element index), so results do not depend on chunk size.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch

from .codecs import EncodedTensor, FP32Codec
from .codecs.rounding import RoundingContext, state_seed, stream_key
from .dtensor import (agree_on_flags, any_distributed, global_flat_offset, is_dtensor, like_param, local,
                      slab_placements)
from .fused import FusedPath
from .policy import ParamInfo, Policy
from .store import ParamState, StateMap, allocate, allocate_many, copy_scalar, is_scalar_state, matches
from .transfer import Transfers

log = logging.getLogger("optstate")

#: torch.optim optimizers whose update is elementwise, so a parameter may be stepped in tiles.
ELEMENTWISE = tuple(getattr(torch.optim, n) for n in (
    "SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Adagrad", "Adadelta", "ASGD", "Rprop")
    if hasattr(torch.optim, n))
TILE_GRANULARITY = 256  # every codec's block size divides this


def unhooked_step(optimizer: torch.optim.Optimizer):
    """The optimizer's ``step`` without torch's hook wrapper (our own step fires the hooks once)."""
    fn = type(optimizer).step
    if getattr(fn, "hooked", False):
        fn = fn.__wrapped__
    return fn


def describe_param(info: ParamInfo) -> str:
    where = f"group {info.group_index}, index {info.index}, shape {tuple(info.shape)}"
    return f"parameter {info.name!r} ({where})" if info.name else f"parameter ({where})"


@dataclass
class StepMetrics:
    """Wall-clock (host) milliseconds per phase of the last step and what it moved."""

    materialize_ms: float = 0.0
    inner_step_ms: float = 0.0
    commit_ms: float = 0.0
    total_ms: float = 0.0
    chunks: int = 0
    tiles: int = 0
    h2d_bytes: int = 0
    d2h_bytes: int = 0
    nonfinite_skipped: int = 0
    peak_materialized_bytes: int = 0  # largest full-precision state decoded at once (one chunk)
    fused_params: int = 0  # parameters stepped by the fused kernels
    kernel_launches: int = 0

    def as_dict(self) -> dict:
        return dict(self.__dict__)


class StepBoundary:
    """Whether the next backward ends in an optimizer step (set by integrations, or read from a
    bound callable such as Accelerate's ``sync_gradients``). Default: every backward steps."""

    def __init__(self):
        self.flag = True
        self.source = None

    def set(self, will_step: bool) -> None:
        self.flag = will_step

    @property
    def will_step(self) -> bool:
        return bool(self.source()) if self.source is not None else self.flag

    def __getstate__(self):
        return {"flag": self.flag, "source": None}


class Work:
    """One parameter's share of a step. ``key`` is the parameter as the groups hold it (maybe a
    DTensor); ``param`` and ``grad`` are the local tensors the math runs on."""

    __slots__ = ("key", "param", "grad", "info", "state", "tiles_left", "dest", "scalars", "new_scalars", "rows",
                 "cols", "offset")

    def __init__(self, param, info, state):
        self.key = param
        self.param = local(param)
        self.grad = local(param.grad)
        self.info = info
        self.state: ParamState = state
        self.rows, self.cols = _slab(self.param.shape)
        self.offset = global_flat_offset(param)  # first local element's index in the global tensor
        self.tiles_left = 0
        self.dest: Dict[str, object] = {}
        self.scalars = {k: copy_scalar(v) for k, v in state.items() if is_scalar_state(v)}
        self.new_scalars: Dict[str, object] = {}


def _slab(shape):
    numel = math.prod(shape)
    rows = shape[0] if len(shape) >= 2 else 1
    return rows, (numel // rows if rows else 0)


@dataclass
class Tile:
    """A flat element range ``[start, stop)`` of one parameter, as a 2-D slab region."""

    work: Work
    start: int
    stop: int
    r0: int
    r1: int
    c0: int
    c1: int
    whole: bool
    tensor: Optional[torch.Tensor] = None
    states: Dict[str, object] = field(default_factory=dict)

    @property
    def numel(self) -> int:
        return self.stop - self.start

    @property
    def slab_shape(self):
        return (self.r1 - self.r0, self.c1 - self.c0)


class Engine:
    """Holds the state mapping and runs steps for one wrapped optimizer."""

    def __init__(self, inner: torch.optim.Optimizer, policy: Policy, *, chunk_bytes: int, chunk_size: Optional[int],
                 initial_chunk_size: Optional[int], pin_memory: Optional[bool], skip_nonfinite: bool, seed: int,
                 elementwise: Optional[bool], names: Dict[int, str], fused: Optional[bool] = None,
                 stochastic_param_rounding: bool = False, gpu_budget=None, staging_bytes: int = 256 * 2**20,
                 prefetch_during_backward: bool = False):
        self.inner = inner
        self.policy = policy
        self.state = StateMap()
        self.step_count = 0
        self.chunk_bytes = chunk_bytes
        self.chunk_size = chunk_size
        self.initial_chunk_size = initial_chunk_size
        self.pin_memory = pin_memory
        self.skip_nonfinite = skip_nonfinite
        self.seed = seed
        self.elementwise = isinstance(inner, ELEMENTWISE) if elementwise is None else bool(elementwise)
        self.names = names
        self.transfers = Transfers()
        self.fused = FusedPath(self, fused, stochastic_param_rounding)
        self.boundary = StepBoundary()
        self.observe_closure_loss = True
        self.metrics = StepMetrics()
        self._plan_cache = None
        self.gpu_budget = gpu_budget  # bytes (int), fraction of free GPU memory (float), or None
        self.staging_bytes = staging_bytes
        self.prefetch_during_backward = prefetch_during_backward
        self.force_tier: Optional[str] = None  # "host" after offload()
        self.offload_all = False
        self.resident: Optional[set] = None  # ids of parameters kept on the device under the budget
        self.nonfinite_host = 0  # parameters skipped for NaN/inf gradients (reference paths)
        self._nonfinite_reported = 0

    # -- decisions ---------------------------------------------------------------------------------
    def codec_of(self, w: "Work", key: str):
        """The policy's codec, unless the parameter's sharding cannot keep whole blocks per rank."""
        codec = self.policy.codec_for(w.info, key, self.step_count)
        if not codec.lossless and is_dtensor(w.key) and slab_placements(w.key) is None:
            return FP32Codec()
        return codec

    # -- tiers -------------------------------------------------------------------------------------
    def tier_of(self, w: "Work", key: str) -> str:
        """Where a state lives between steps: the policy's answer, then the GPU budget."""
        if self.force_tier is not None:
            return self.force_tier
        tier = self.policy.tier_for(w.info, key, self.step_count)
        if self.offload_all:
            return "host"
        if tier == "device" and self.resident is not None and id(w.key) not in self.resident:
            return "host"
        return tier

    def budget_bytes(self, device: torch.device) -> Optional[int]:
        if self.gpu_budget is None:
            return None
        if isinstance(self.gpu_budget, float):
            free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 0
            self.gpu_budget = int(free * self.gpu_budget)
        return self.gpu_budget

    def staging_size(self, device: torch.device) -> int:
        budget = self.budget_bytes(device)
        return self.staging_bytes if budget is None else max(4096, min(self.staging_bytes, budget // 2))

    def _assign_residency(self, works: List["Work"]) -> None:
        """Under a GPU budget: keep state resident in step order while it fits beside the staging
        ring; the rest streams from host memory every step."""
        if self.gpu_budget is None or not works:
            self.resident = None
            return
        device = works[0].param.device
        room = self.budget_bytes(device) - self.staging_size(device)
        resident = set()
        for w in works:
            keys = [k for k, v in w.state.items() if not is_scalar_state(v)] or ["exp_avg", "exp_avg_sq"]
            need = 0
            for key in keys:
                codec = self.codec_of(w, key)
                need += codec.nbytes(w.rows, w.cols, w.param.dtype if not codec.lossless else torch.float32)
            if need <= room:
                resident.add(id(w.key))
                room -= need
        self.resident = resident

    # -- the parameters, as they are now ------------------------------------------------------
    def param_infos(self):
        """``(param, ParamInfo)`` for every parameter of the live groups, in checkpoint order."""
        index = 0
        for gi, group in enumerate(self.inner.param_groups):
            names = group.get("param_names")
            for j, p in enumerate(group["params"]):
                name = names[j] if names and j < len(names) else self.name_of(p)
                yield p, ParamInfo(index, gi, tuple(p.shape), p.dtype, name)
                index += 1

    def name_of(self, p) -> Optional[str]:
        """``wrap(named_parameters=...)`` first, then names the policy learned (``bind_names``)."""
        name = self.names.get(id(p))
        if name is None and hasattr(self.policy, "name_of"):
            name = self.policy.name_of(p)
        return name

    def collect(self) -> List[Work]:
        """Validate every gradient, then return the work of this step (nothing changed yet)."""
        works = []
        for p, info in self.param_infos():
            g = p.grad
            if g is None:
                continue
            if g.is_sparse or g.layout != torch.strided:
                raise ValueError(f"{describe_param(info)} has a sparse gradient; optstate keeps dense state only. "
                                 "Step it with an unwrapped optimizer that supports sparse gradients.")
            if g.shape != p.shape:
                raise ValueError(f"{describe_param(info)} has a gradient of shape {tuple(g.shape)}")
            if g.is_complex() != p.is_complex():
                raise ValueError(f"{describe_param(info)}: gradient and parameter disagree on being complex")
            works.append(Work(p, info, self.state[p] if p in self.state else ParamState()))
        return works

    def _drop_nonfinite(self, works: List[Work]) -> List[Work]:
        by_device: Dict[torch.device, List[int]] = {}
        for i, w in enumerate(works):
            if w.grad.numel():
                by_device.setdefault(w.grad.device, []).append(i)
        finite = [True] * len(works)
        distributed = any_distributed([w.key for w in works])
        for idx in by_device.values():
            norms = torch._foreach_norm([works[i].grad for i in idx], float("inf"))
            bad = (~torch.isfinite(torch.stack([n.float() for n in norms]))).to(torch.int32)
            if distributed:  # a shard's NaN skips the parameter on every rank
                bad = agree_on_flags(bad)
            for i, flag in zip(idx, bad.tolist()):  # the step's one sync
                finite[i] = not flag
        kept = [w for w, ok in zip(works, finite) if ok]
        skipped = len(works) - len(kept)
        if skipped:
            self.nonfinite_host += skipped
            names = ", ".join(describe_param(w.info) for w, ok in zip(works, finite) if not ok)
            log.warning("step %d: non-finite gradient, update skipped for %s", self.step_count, names)
        self.metrics.nonfinite_skipped = skipped
        return kept

    # -- a step --------------------------------------------------------------------------------
    def step(self) -> None:
        t0 = time.perf_counter()
        self.metrics = StepMetrics()
        self.transfers.reset()
        signature = self._signature()
        cached = self._cached_plan(signature)
        if cached is None:
            buckets = self._plan_and_run(signature)
        else:
            buckets, passthrough = cached
            if passthrough:
                t = time.perf_counter()
                self._run_inner(passthrough, use_real_state=True)
                self.metrics.inner_step_ms += (time.perf_counter() - t) * 1e3
        if buckets:
            t = time.perf_counter()
            self.fused.launch_all(buckets)
            self.metrics.inner_step_ms += (time.perf_counter() - t) * 1e3
        self.step_count += 1
        self.metrics.h2d_bytes = self.transfers.h2d_bytes
        self.metrics.d2h_bytes = self.transfers.d2h_bytes
        self.metrics.total_ms = (time.perf_counter() - t0) * 1e3

    def _plan_and_run(self, signature):
        """Plan this step from scratch; run the reference paths; return the fused buckets."""
        works = self.collect()
        self._assign_residency(works)
        passthrough, fused, tiled = [], [], []
        for w in works:
            if not self._needs_tiles(w):
                passthrough.append(w)
                continue
            plan = self.fused.plan(w)
            if plan is not None:
                fused.append((w, plan))
            else:
                tiled.append(w)
        if fused and passthrough:
            # uncompressed tensors next to fused ones (small-tensor bypass): step them in the
            # same launches, so the step needs no host synchronisation and no second optimizer
            still = []
            for w in passthrough:
                plan = self.fused.plan(w, allow_uncompressed=True)
                (fused.append((w, plan)) if plan is not None else still.append(w))
            passthrough = still
        if self.skip_nonfinite and (passthrough or tiled):  # the fused path flags on the device
            kept = {id(w) for w in self._drop_nonfinite(passthrough + tiled)}
            passthrough = [w for w in passthrough if id(w) in kept]
            tiled = [w for w in tiled if id(w) in kept]
        buckets = self.fused.build(fused) if fused else []
        if passthrough:
            t = time.perf_counter()
            self._run_inner([(w.key, w.state, w.info.group_index) for w in passthrough], use_real_state=True)
            self.metrics.inner_step_ms += (time.perf_counter() - t) * 1e3
        if tiled:
            self._run_tiled(tiled, update=True)
        items = [(w.key, w.state, w.info.group_index) for w in passthrough]
        cacheable = not tiled and not any(b.first for b in buckets) and all(w.state for w in passthrough) \
            and len(fused) + len(passthrough) == len(works)
        params = [k for b in buckets for k in b.keys] + [p for p, _, _ in items]
        self._plan_cache = (signature, buckets, items, self._state_identity(params)) if cacheable else None
        self.fused.index_offloaded(buckets if cacheable else [])
        return buckets

    def _signature(self):
        """What a cached plan depends on besides the state objects: the parameters with
        gradients, group options that change eligibility, and the policy's decisions now."""
        parts = []
        for g in self.inner.param_groups:
            parts.append((g.get("amsgrad"), g.get("maximize"), g.get("differentiable"), g.get("momentum"),
                          g.get("nesterov"), isinstance(g.get("lr"), torch.Tensor)))
            parts.extend((id(p), p.grad is not None) for p in g["params"])
        return tuple(parts), self.policy.decision_key(self.step_count), self.skip_nonfinite

    def _state_identity(self, params):
        return [(p, self.state.get(p), tuple(map(id, self.state[p].values()))) for p in params]

    def _cached_plan(self, signature):
        """The previous step's plan (fused buckets, passthrough items) if nothing it depends on
        changed; only cheap identity checks. The full path validates and explains otherwise."""
        cache = self.__dict__.get("_plan_cache")
        if cache is None or cache[0] != signature:
            return None
        _, buckets, items, identity = cache
        for p, st, ids in identity:
            if self.state.get(p) is not st or tuple(map(id, st.values())) != ids:
                return None
            g = p.grad
            if g.layout != torch.strided or g.shape != p.shape or g.dtype != p.dtype or not g.is_contiguous():
                return None
        if items and self.skip_nonfinite and not self._all_finite([p.grad for p, _, _ in items]):
            return None  # rare: the full path skips and reports the parameters
        self.metrics.nonfinite_skipped = 0
        return buckets, items

    @staticmethod
    def _all_finite(grads) -> bool:
        by_device: Dict[torch.device, list] = {}
        for g in grads:
            if g.numel():
                by_device.setdefault(g.device, []).append(g)
        for gs in by_device.values():
            norms = torch._foreach_norm(gs, float("inf"))
            if not bool(torch.isfinite(torch.stack([n.float() for n in norms])).all()):  # one sync
                return False
        return True

    def invalidate_plan(self) -> None:
        """Forget the cached step plan (after loading state or moving it between tiers)."""
        self._plan_cache = None
        self.fused.index_offloaded([])

    # -- whole-state moves -----------------------------------------------------------------------
    def sync_transfers(self) -> None:
        """Wait for queued write-backs of offloaded state (before reading or replacing it)."""
        self.fused.sync()

    def offload(self) -> None:
        """Move every state to host memory (idempotent)."""
        self.sync_transfers()
        self.force_tier = "host"
        self.conform()

    def reload(self) -> None:
        """Bring state back to the device as far as the policy and the GPU budget allow."""
        self.sync_transfers()
        self.force_tier = None
        self.resident = None
        if self.gpu_budget is not None:
            self._assign_residency([Work(p, info, self.state[p]) for p, info in self.param_infos() if p in self.state])
        self.conform()

    def close(self) -> None:
        """Release staging memory, streams and all state (pinned buffers included)."""
        self.fused.close()
        self.invalidate_plan()
        self.state.clear()

    def nonfinite_skipped(self) -> int:
        """Parameters skipped for NaN/inf gradients so far (reads the fused path's device counter)."""
        device = self.fused.nonfinite_device
        total = self.nonfinite_host + (int(device.item()) if device is not None else 0)
        if device is not None and total > self._nonfinite_reported:
            log.warning("optstate: %d parameter updates skipped for non-finite gradients so far",
                        total)
        self._nonfinite_reported = total
        return total

    def _needs_tiles(self, w: Work) -> bool:
        tensors = {k: v for k, v in w.state.items() if not is_scalar_state(v)}
        if not tensors:  # first step: tiles unless the state will be plain device tensors
            return self.policy.may_compress(w.info, self.step_count) or self.tier_of(w, "") == "host"
        for key, value in tensors.items():
            if isinstance(value, EncodedTensor):
                return True
            codec = self.codec_of(w, key)
            host = self.tier_of(w, key) == "host"
            if not matches(value, codec, host, w.param.device):
                return True
        return False

    def _run_inner(self, items, use_real_state: bool) -> None:
        """Run the inner optimizer's own update on ``(tensor, state dict, group index)`` items.

        The inner optimizer sees shadow copies of the live groups (same hyper-parameters, only
        these tensors), so the shared group dicts are never modified.
        """
        inner = self.inner
        groups_by_index: Dict[int, List[torch.Tensor]] = {}
        for tensor, _, gi in items:
            groups_by_index.setdefault(gi, []).append(tensor)
        shadow = [dict(inner.param_groups[gi], params=ts) for gi, ts in groups_by_index.items()]
        saved_groups, saved_state = inner.param_groups, inner.state
        tmp_state = self.state if use_real_state else _TileState()
        if not use_real_state:
            for tensor, state, _ in items:
                tmp_state[tensor] = state
        try:
            inner.param_groups = shadow
            inner.state = tmp_state
            unhooked_step(inner)(inner)
        finally:
            inner.param_groups = saved_groups
            inner.state = saved_state

    # -- tiles and chunks ------------------------------------------------------------------------
    def _tiles_of(self, w: Work, max_elems: int) -> List[Tile]:
        p = w.param
        numel, rows, cols = p.numel(), w.rows, w.cols
        tileable = self.elementwise and p.is_contiguous() and all(
            is_scalar_state(v) or (tuple(v.shape) == tuple(p.shape) and
                                   (isinstance(v, EncodedTensor) or v.is_contiguous()))
            for v in w.state.values())
        if not tileable or numel <= max_elems:
            return [Tile(w, 0, numel, 0, rows, 0, cols, whole=True)]
        tiles = []
        if cols <= max_elems:
            per = max(1, max_elems // cols)
            for r in range(0, rows, per):
                r1 = min(rows, r + per)
                tiles.append(Tile(w, r * cols, r1 * cols, r, r1, 0, cols, whole=False))
        else:
            width = max(TILE_GRANULARITY, max_elems // TILE_GRANULARITY * TILE_GRANULARITY)
            for r in range(rows):
                for c in range(0, cols, width):
                    c1 = min(cols, c + width)
                    tiles.append(Tile(w, r * cols + c, r * cols + c1, r, r + 1, c, c1, whole=False))
        return tiles

    def _chunks(self, works: List[Work]):
        n_keys = max([sum(1 for v in w.state.values() if not is_scalar_state(v)) for w in works] + [2])
        max_elems = max(TILE_GRANULARITY, self.chunk_bytes // (4 * n_keys))
        max_count = self.chunk_size
        if self.step_count == 0 and self.initial_chunk_size:
            first_count = self.initial_chunk_size
        else:
            first_count = max_count
        chunk, used = [], 0
        for w in works:
            tiles = self._tiles_of(w, max_elems)
            w.tiles_left = len(tiles)
            for tile in tiles:
                limit = first_count if not self.metrics.chunks else max_count
                if chunk and (used + tile.numel > max_elems or (limit and len(chunk) >= limit)):
                    yield chunk
                    self.metrics.chunks += 1
                    chunk, used = [], 0
                chunk.append(tile)
                used += tile.numel
        if chunk:
            self.metrics.chunks += 1
            yield chunk

    def _preallocate(self, works: List[Work]) -> None:
        """Destinations for states that change form this step, one allocation per form."""
        wanted: Dict[tuple, list] = {}
        for w in works:
            for key, value in w.state.items():
                if is_scalar_state(value) or tuple(local(value).shape) != tuple(w.param.shape):
                    continue
                codec = self.codec_of(w, key)
                host = self.tier_of(w, key) == "host"
                if not matches(value, codec, host, w.param.device):
                    wanted.setdefault((codec, host, w.param.device, value.dtype), []).append((w, key))
        for (codec, host, device, dtype), items in wanted.items():
            pin = self.pin_memory if self.pin_memory is not None else device.type == "cuda"
            values = allocate_many(codec, [w.param.shape for w, _ in items], dtype, device, host, pin)
            for (w, key), value in zip(items, values):
                w.dest[key] = like_param(w.key, value) if isinstance(value, torch.Tensor) and is_dtensor(w.key) \
                    else value

    def _run_tiled(self, works: List[Work], update: bool) -> None:
        self._preallocate(works)
        for chunk in self._chunks(works):
            t0 = time.perf_counter()
            for tile in chunk:
                self._materialize(tile)
            t1 = time.perf_counter()
            if update:
                self._run_inner([(t.tensor, t.states, t.work.info.group_index) for t in chunk],
                                use_real_state=False)
            t2 = time.perf_counter()
            materialized = sum(_materialized_bytes(tile) for tile in chunk)
            self.metrics.peak_materialized_bytes = max(self.metrics.peak_materialized_bytes, materialized)
            for tile in chunk:
                self._commit(tile)
            t3 = time.perf_counter()
            self.metrics.materialize_ms += (t1 - t0) * 1e3
            self.metrics.inner_step_ms += (t2 - t1) * 1e3
            self.metrics.commit_ms += (t3 - t2) * 1e3
            self.metrics.tiles += len(chunk)

    def _materialize(self, tile: Tile) -> None:
        """Build the tile's parameter/gradient views and its full-precision state."""
        w, p = tile.work, tile.work.param
        if tile.whole:
            tile.tensor = p.detach()
            if w.grad is not None:
                tile.tensor.grad = w.grad
        else:
            tile.tensor = p.detach().view(-1)[tile.start:tile.stop]
            if w.grad is not None:
                tile.tensor.grad = w.grad.reshape(-1)[tile.start:tile.stop]
        states = {}
        for key, value in w.state.items():
            if is_scalar_state(value):
                states[key] = copy_scalar(w.scalars[key])
            elif isinstance(value, EncodedTensor):
                states[key] = self._decode_tile(value, tile, p.device)
            else:
                if value.device != p.device:
                    value = w.state[key] = value.to(p.device)
                value = local(value)
                states[key] = value if tile.whole else value.view(-1)[tile.start:tile.stop]
        tile.states = states

    def _decode_tile(self, enc: EncodedTensor, tile: Tile, device) -> torch.Tensor:
        shape = enc.shape if tile.whole else (tile.numel,)
        out = torch.empty(shape, dtype=enc.dtype, device=device)
        if tile.numel:
            payload = enc.codec.slice_payload(enc.payload, slice(tile.r0, tile.r1), tile.c0, tile.c1, tile.work.cols)
            enc.codec.decode_into(self.transfers.fetch(payload, device), out.view(tile.slab_shape))
        return out

    def _commit(self, tile: Tile) -> None:
        w = tile.work
        step = self.step_count
        for key, value in tile.states.items():
            if is_scalar_state(value):
                w.new_scalars.setdefault(key, value)
                continue
            dest = w.dest.get(key)
            if dest is None:
                dest = w.dest[key] = self._destination(w, key, value)
            if isinstance(dest, torch.Tensor):
                dest = local(dest)
                target = dest if tile.whole else dest.view(-1)[tile.start:tile.stop]
                if target.data_ptr() != value.data_ptr():
                    target.copy_(value.reshape(target.shape))
            elif tile.numel:
                self._encode_tile(dest, tile, key, value, step)
        tile.states = {}
        tile.tensor = None
        w.tiles_left -= 1
        if w.tiles_left == 0:
            w.state.update(w.new_scalars)
            w.state.update(w.dest)
            self.state[w.key] = w.state

    def _destination(self, w: Work, key: str, value: torch.Tensor):
        codec = self.codec_of(w, key)
        host = self.tier_of(w, key) == "host"
        current = w.state.get(key)
        if current is not None and matches(current, codec, host, w.param.device):
            return current
        pin = self.pin_memory if self.pin_memory is not None else w.param.device.type == "cuda"
        dest = allocate(codec, w.param.shape, value.dtype, w.param.device, host, pin)
        return like_param(w.key, dest) if isinstance(dest, torch.Tensor) and is_dtensor(w.key) else dest

    def _encode_tile(self, dest: EncodedTensor, tile: Tile, key: str, value: torch.Tensor, step: int) -> None:
        codec = dest.codec
        view = codec.slice_payload(dest.payload, slice(tile.r0, tile.r1), tile.c0, tile.c1, tile.work.cols)
        rounding = None
        if codec.stochastic_rounding:
            seed = state_seed(self.seed, tile.work.info.index, key)
            rounding = RoundingContext(stream_key(seed, step), tile.work.offset + tile.start, tile.work.cols)
        x = value.reshape(tile.slab_shape)
        if dest.host_tier and x.device.type != "cpu":
            staged = {k: torch.empty_like(v, device=x.device) for k, v in view.items()}
            codec.encode_into(x, staged, rounding)
            self.transfers.put(staged, view)
        else:
            codec.encode_into(x, view, rounding)

    # -- whole-state conversions (load, offload/reload) -----------------------------------------
    def conform(self, params=None) -> None:
        """Re-store state in the form the policy wants now (no update), tile by tile; a state
        that only changes tier is copied as it is."""
        self.invalidate_plan()
        self.sync_transfers()
        wanted = None if params is None else {id(p) for p in params}
        works = []
        for p, info in self.param_infos():
            if p in self.state and (wanted is None or id(p) in wanted):
                w = Work(p, info, self.state[p])
                if any(not is_scalar_state(v) for v in w.state.values()) and self._needs_tiles(w):
                    works.append(w)
        works = self._retier(works)
        if works:
            self._run_tiled(works, update=False)

    def _retier(self, works: List[Work]) -> List[Work]:
        """Move encoded states whose codec stays the same by copying their payload; return the
        works that still need a re-encode."""
        moves: Dict[tuple, list] = {}
        for w in works:
            for key, value in w.state.items():
                if not isinstance(value, EncodedTensor):
                    continue
                codec = self.codec_of(w, key)
                host = self.tier_of(w, key) == "host"
                if value.codec == codec and not matches(value, codec, host, w.param.device):
                    moves.setdefault((codec, host, w.param.device, value.dtype), []).append((w, key, value))
        for (codec, host, device, dtype), items in moves.items():
            pin = self.pin_memory if self.pin_memory is not None else device.type == "cuda"
            for (w, key, src), dst in zip(items, allocate_many(codec, [v.shape for _, _, v in items], dtype,
                                                                device, host, pin)):
                for name, t in dst.payload.items():
                    t.copy_(src.payload[name])
                w.state[key] = dst
        return [w for w in works if self._needs_tiles(w)]


def _materialized_bytes(tile: Tile) -> int:
    """Bytes of full-precision state a tile holds beyond the stored state (fresh buffers)."""
    total = 0
    for key, value in tile.states.items():
        if is_scalar_state(value):
            continue
        stored = tile.work.state.get(key)
        if isinstance(stored, torch.Tensor) and \
                value.untyped_storage().data_ptr() == stored.untyped_storage().data_ptr():
            continue
        total += value.numel() * value.element_size()
    return total


class _TileState(dict):
    """The inner optimizer's view of state during a tiled chunk (defaultdict-like, like torch)."""

    def __missing__(self, key):
        value = self[key] = {}
        return value
