"""Gradient release and gradient-norm clipping: update parameters in backward, free their gradients.

With ``release_gradients=True``, on the micro-batch that ends an accumulation window (the step
boundary, :class:`~optstate_core.schedule.timetable.StepBoundary`) the step schedule's backward hook
(phase 1) hands each parameter here as soon as its gradient is final. Released parameters wait in
a batch until ``release_bucket_bytes`` of gradients are pending or backward ends; then the batch is
clipped, updated through the engine's router (the paths ``step()`` would take) and its gradients
are freed, so at most a batch of gradients exists at a time. ``step()`` then only advances the
step count (and updates any parameter whose gradient was not released); ``zero_grad()`` has
nothing left.

Clipping (``max_grad_norm``) cannot see the global norm before the first update when gradients
are released, so ``clip_mode`` chooses:

* ``"global"`` (only without release): torch's ``clip_grad_norm_`` over every gradient in
  ``step()``, exactly as a training loop would;
* ``"auto"`` (release default): when one batch holds every gradient of the step (they fit in
  ``release_bucket_bytes``), they are clipped by their exact global norm at the end of backward,
  exactly as global clipping would; otherwise per tensor (the rule that stayed closest to global
  clipping when the step spans several batches: docs/benchmarks-journal.md sections 22 and 23); under FSDP2,
  ``"previous"``;
* ``"previous"``: the exact global norm when one batch holds the step; otherwise every gradient
  of step t is scaled by ``min(1, max_grad_norm / (norm_{t-1} + 1e-6))``, where ``norm_{t-1}``
  is the previous step's global norm (computed during its release pass, pre-clip); the first
  step clips per tensor.
  Same direction as global clipping, one step late: a sudden spike passes unclipped once;
* ``"per_tensor"``: each gradient is scaled so that its own norm is at most ``max_grad_norm``
  (no lag, but the global norm may reach ``sqrt(n_tensors) * max_grad_norm``).

``last_grad_norm`` is the global 2-norm of the last step's gradients before clipping (a tensor).

Under FSDP2 the hook is the one FSDP2 calls on each sharded parameter after its reduce-scatter
(on its post-reduce stream, so the update is ordered after the reduced gradient and before the
next forward's all-gather): each rank updates its local shard. Norms are taken over local
shards; the global norm (``last_grad_norm`` and the ``"previous"`` factor) sums their squares
over the ranks in one all-reduce of one number per step, at the end of ``step()``. Clipping
that needs a tensor's own norm before that (``"per_tensor"``, and the first step of
``"previous"`` and ``"auto"``) clips each local shard to ``max_grad_norm`` (without a collective per
parameter). NaN/inf skipping is per 256-element block of the local shard (fused kernels) or per
parameter across ranks (other paths), as without release.
"""
from __future__ import annotations

import logging
from typing import Dict, Optional

import torch
from torch.autograd import Variable

from ..state.dtensor import local
from ..step.gradients import collect
from ..step.inner import group_signature
from .park import wake_for_update
from .release_params import follow_parameters

log = logging.getLogger("optstate")

CLIP_MODES = ("auto", "global", "previous", "per_tensor")
EPS = 1e-6
#: released gradients pending before one batched update (``wrap(release_bucket_bytes=...)``): a
#: launch per parameter costs ~0.1 ms of host time on a GPU (pointer tables, Triton's launcher),
#: and a few hundred MB of gradients is little beside what release frees
DEFAULT_BUCKET_BYTES = 256 * 2**20
#: how many released batches' offloaded state is staged ahead of their update by default
#: (:meth:`ClipAndRelease.stage_next`; ``tuning.stage_ahead``, ``OPTSTATE_STAGE_AHEAD``; 0: off, every
#: released batch then streams through the staging ring, to measure what staging gains)
DEFAULT_STAGE_AHEAD = 2


def check_clip_options(max_grad_norm, clip_mode: str, release: bool):
    """Validate the clipping options; returns ``(max_grad_norm or None, effective mode)``."""
    if max_grad_norm is not None:
        if isinstance(max_grad_norm, bool) or not isinstance(max_grad_norm, (int, float)) or \
                not max_grad_norm > 0 or max_grad_norm == float("inf"):
            raise ValueError(f"max_grad_norm must be None or a finite number > 0, got {max_grad_norm!r}")
        max_grad_norm = float(max_grad_norm)
    if clip_mode not in CLIP_MODES:
        raise ValueError(f"clip_mode must be one of {', '.join(CLIP_MODES)}, got {clip_mode!r}")
    if clip_mode == "auto" and not release:
        clip_mode = "global"
    if release and clip_mode == "global":
        raise ValueError("clip_mode='global' needs every gradient before the first update, which "
                         "release_gradients=True frees in backward; use clip_mode='auto', 'previous' or 'per_tensor'")
    return max_grad_norm, clip_mode


class ClipAndRelease:
    """Batched updates of released parameters from the backward hooks, and clipping for both modes of stepping."""

    def __init__(self, engine, release: bool, max_grad_norm: Optional[float], clip_mode: str,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, stage_ahead: int = DEFAULT_STAGE_AHEAD):
        self.engine = engine
        self.release = release
        self.bucket_bytes = bucket_bytes  # released gradients wait until this many bytes are pending
        self.max_grad_norm = max_grad_norm
        self.clip_mode = clip_mode
        self.last_grad_norm: Optional[torch.Tensor] = None  # global norm of the last step, pre-clip
        self._scale: Optional[torch.Tensor] = None  # the previous step's clip factor ("previous")
        self._norms = []  # this step's per-gradient norms so far (fp32 vectors, one per clipped list; pre-clip)
        self._scaled = None  # ``_scale`` cast for the gradients of this step: (device, dtype, tensor, its fp32 copy)
        self._infos: Dict[int, object] = {}
        self._buckets: Dict[tuple, tuple] = {}  # ids of a batch's params -> (its buckets, their keys)
        self._pending = []  # (param, ParamInfo) released, waiting for their batch's update
        self._pending_bytes = 0
        self._partial = False  # a batch of this step was updated before backward ended
        self._exact_norm: Optional[torch.Tensor] = None  # this step's global norm, when one batch held it all
        self.released = 0  # parameters updated in backward this step
        self._released_ids = set()  # ids of those: a second backward before step() must not update them again
        self._order = []  # this step's batches (ids of their parameters), in update order
        self._last_order = []  # the previous step's: predicts which batch comes next (stage_next)
        self._staged_to = 0  # positions of _last_order below this were staged (or passed) this step
        self._ahead = stage_ahead  # batches staged ahead (tuning.stage_ahead)
        self.group = None  # FSDP2: the process group whose ranks hold the shards (check_release_supported)
        self.param_ids = None  # ids of the parameters the hooks are on (release_params.follow_parameters)
        self.deferred_check = False  # plain parameters under several processes at wrap(): checked again later
        self._update_listeners = []  # called with each released batch's parameters once updated (weight_stream.py)
        self.stream = None  # the WeightStream riding on these updates, once started (weight_stream.start)

    # -- backward (phase 1 of the step schedule) ---------------------------------------------------
    def __call__(self, param) -> None:
        """Backward hook on the boundary micro-batch: queue this parameter for its batch's update;
        once ``bucket_bytes`` of gradients are pending (and at the end of backward), :meth:`flush`."""
        if param.grad is None:
            return
        info = self._info_of(param)
        if info is None:
            return
        if id(param) in self._released_ids:
            raise RuntimeError(
                "optstate: release_gradients=True and a second backward before step(): this parameter was "
                "already updated with the previous backward's gradient. With gradient accumulation call "
                "optimizer.set_step_boundary(False) before each backward that does not end in a step and "
                "set_step_boundary(True) before the last one (the integrations do it for you; Lightning Fabric "
                "and plain loops: docs/lightning.md#fabric)")
        if not self._pending:  # the first of this backward: the rest goes when backward ends
            self.check_streaming()
            wake_for_update(self.engine, "a gradient released in backward")
            if self.deferred_check:  # still plain parameters under several processes (DDP): refused here
                follow_parameters(self.engine)
            self.engine.schedule.staged_ahead = False  # the first batch's copy is now this backward's
            try:
                Variable._execution_engine.queue_callback(self.flush)
            except RuntimeError:  # called outside a backward (by hand): step() flushes
                pass
        grad = local(param.grad)
        self._released_ids.add(id(param))
        self._pending.append((param, info))
        self._pending_bytes += grad.numel() * grad.element_size()
        self.released += 1
        if self._pending_bytes >= self.bucket_bytes:
            self.flush(final=False)

    def flush(self, final: bool = True) -> None:
        """Clip, update and free the pending released gradients: one launch per kind of state for
        the whole batch (the same paths step() would take), then every gradient is dropped.
        ``final``: backward has ended. If no batch went before in this step, the batch holds every
        gradient of the step, and ``"previous"`` clipping uses their exact global norm, as
        ``clip_grad_norm_`` after backward would (release then equals no release bit for bit)."""
        if not self._pending:
            return
        items, self._pending, self._pending_bytes = self._pending, [], 0
        whole = final and not self._partial and self.max_grad_norm is not None and \
            self.clip_mode in ("previous", "auto") and self.group is None
        self._partial = self._partial or not final
        with torch.no_grad():
            if whole:  # in the parameters' order, as a clipping call over model.parameters() sums them
                items.sort(key=lambda item: item[1].index)
                self._exact_norm = torch.nn.utils.clip_grad_norm_([p for p, _ in items], self.max_grad_norm,
                                                                  foreach=None)
            batch = tuple(id(p) for p, _ in items)
            self.step_params(items, batch, clip=not whole)
        for p, _ in items:
            p.grad = None
        for listener in self._update_listeners:
            listener([p for p, _ in items])
        self._order.append(batch)
        self.stage_next()

    def add_update_listener(self, listener) -> None:
        """Call ``listener(params)`` after each released batch is updated (its updates queued)."""
        self._update_listeners.append(listener)

    def remove_update_listener(self, listener) -> None:
        self._update_listeners = [f for f in self._update_listeners if f != listener]  # bound methods: equal, not identical

    def check_streaming(self) -> None:
        """Refuse an update (before any) when the optimizer wants its weights streamed but none was started."""
        if self.stream is None and self.engine.options.stream_weights:
            raise RuntimeError("optstate: the optimizer was wrapped with stream_weights=True (or a '-stream' preset) "
                               "but no weight stream was started, so nothing was updated: call "
                               "opt.stream_weights(model) or optstate_core.stream_weights(model, opt) before training "
                               "(the HF and Lightning callbacks do it when training begins)")

    def stage_next(self) -> bool:
        """Upload the offloaded state of the next ``tuning.stage_ahead`` batches expected (the
        previous step's batches at the positions after this one; at the
        end of a step, the next step's first) while backward, or the next forward, computes: their
        updates then find the state on the device. Batches whose state is all resident (under a
        ``gpu_budget``) are passed over, not counted: the next streamed batches upload behind the
        forward and the resident updates. The device holds at most that many + 1 batches' staged
        state. Returns whether anything was staged."""
        staged = False
        end, found = len(self._order), 0
        while end < len(self._last_order) and found < self._ahead:
            found += self._streams(self._last_order[end])
            end += 1
        for position in range(max(len(self._order), self._staged_to), end):
            entry = self._buckets.get(self._last_order[position])
            if entry is not None:
                staged |= self.engine.schedule.stage([b for b in entry[0] if self._current(b)])
        self._staged_to = max(self._staged_to, end)
        return staged

    def _streams(self, batch: tuple) -> bool:
        """Whether a batch of the previous step has state in host memory (unknown batches count)."""
        entry = self._buckets.get(batch)
        return entry is None or any(b.plan.offload for b in entry[0])

    def _info_of(self, param):
        info = self._infos.get(id(param))
        if info is None:
            self._infos = {id(p): i for p, i in self.engine.param_infos()}
            info = self._infos.get(id(param))
        return info

    def step_params(self, items, batch: tuple, clip: bool = False) -> None:
        """Update these ``(param, ParamInfo)`` now on the paths the engine's router picks, the same
        as in ``step()`` (no step count advance: ``step()`` does that once). The fused kernels skip
        NaN/inf blocks on the device, as in ``step()``, with no host synchronisation; only the other
        paths check on the host. A batch's fused buckets are kept for its next release while
        nothing they depend on changes (:meth:`_cached_buckets`); ``batch``: the ids of the
        batch's parameters, its cache key. ``clip``: note the gradients' norms and clip them by
        this step's rule first (:meth:`_clip`); the fused kernels apply the factors as they read
        the gradients, the other paths get scaled gradients."""
        engine = self.engine
        cached = self._cached_buckets(batch, items)
        routes = None
        if cached is None:
            engine.assign_residency(only_new=True)
            routes = engine.router.route(collect(items, engine.state))
        factors = {}
        if clip:
            fused = None if routes is None else {id(w.key) for w, _ in routes.fused}  # kept: all fused
            factors = self._clip([p.grad for p, _ in items],
                                 [id(p) if fused is None or id(p) in fused else None for p, _ in items])
        if routes is not None:
            engine.run_unfused(routes)
            cached = engine.fused.build(routes.fused) if routes.fused else []
        if cached:
            with engine.kernels.clip_factors(factors):
                engine.schedule.run(cached)
            if routes is not None and len(routes.fused) == len(items):  # launched once: now reusable
                self._buckets[batch] = (cached, self._bucket_keys(items))

    # -- the per-batch bucket cache ----------------------------------------------------------------
    def _bucket_keys(self, items) -> list:
        """Per parameter of a batch, what its kept bucket depends on besides its state objects'
        identity (as the engine's own plan cache: dtype, device, gradient form, group options, the
        policy's decisions); the group signatures and the policy's key are taken once per batch."""
        engine = self.engine
        shared = (engine.policy.decision_key(engine.step_count), engine.skip_nonfinite)
        groups = {}
        keys = []
        for p, info in items:
            g, st = p.grad, engine.state.get(p)
            sig = groups.get(info.group_index)
            if sig is None:
                sig = groups[info.group_index] = group_signature(engine.inner.param_groups[info.group_index])
            keys.append((p.dtype, p.device, g.dtype, g.shape, g.layout, g.is_contiguous(), sig, shared, id(st),
                         tuple(map(id, st.values())) if st is not None else ()))
        return keys

    def _cached_buckets(self, batch: tuple, items):
        """The buckets kept for this batch of parameters if nothing they depend on changed."""
        entry = self._buckets.get(batch)
        if entry is None:
            return None
        buckets, keys = entry
        if not all(map(self._current, buckets)) or keys != self._bucket_keys(items):
            del self._buckets[batch]
            return None
        return buckets

    def _current(self, bucket) -> bool:
        """Whether a kept bucket still holds its parameters' state objects and has launched once."""
        state = self.engine.state
        return not bucket.first and all(s is state.get(k) for k, s in zip(bucket.keys, bucket.states))

    def forget_buckets(self) -> None:
        """Drop the kept buckets (the engine's plan was invalidated: state loaded, moved or recast)."""
        self._buckets.clear()

    def __getstate__(self):
        """Copies keep no buckets (their pointer tables address the original's memory) and nothing pending."""
        state = dict(self.__dict__)
        state.update(_buckets={}, _infos={}, _pending=[], _pending_bytes=0, _partial=False, _exact_norm=None,
                     _order=[], _last_order=[], _staged_to=0, _update_listeners=[], stream=None)
        return state

    # -- clipping ----------------------------------------------------------------------------------
    @property
    def _one_step_late(self) -> bool:
        """Whether a step spread over several batches clips by the previous step's global norm
        ("previous"; "auto" under FSDP2), rather than per tensor."""
        return self.clip_mode == "previous" or (self.clip_mode == "auto" and self.group is not None)

    def _clip(self, grads, fold=None):
        """Note the norms of ``grads`` (pre-clip) and clip them by this step's rule, a few launches
        for the whole list (grouped by device and dtype): the norms in one foreach launch, the
        factors in a few, the scaling in one (a shared factor) or one per gradient. ``fold``: per
        gradient, a key for a gradient whose factor the caller's fused kernels apply as they read
        it (no pass over it here), else None. Returns ``{key: (fp32 tensor, index of its factor)}``
        for :meth:`~optstate_core.step.fused_launch.KernelLauncher.clip_factors`: the factors hold
        the gradient dtype's rounding of themselves, so the kernels' product is bit for bit the
        in-place multiply's."""
        fold = fold if fold is not None else [None] * len(grads)
        groups: Dict[tuple, list] = {}
        for g, key in zip(grads, fold):
            g = local(g)  # FSDP2: the local shards (no collective per parameter)
            groups.setdefault((g.device, g.dtype), []).append((g, key))
        factors_of = {}
        for (device, dtype), group in groups.items():
            norms = torch.stack(_norms_fp32([g for g, _ in group]))
            self._norms.append(norms)  # summed once (norm_so_far, after_step)
            if self.max_grad_norm is None:
                continue
            scaled = [(j, g) for j, (g, key) in enumerate(group) if key is None]
            if self._one_step_late and self._scale is not None:
                cached = self._scaled
                if cached is None or cached[0] != device or cached[1] != dtype:
                    factor = self._scale.to(device, dtype)
                    cached = self._scaled = (device, dtype, factor, factor.float())
                if scaled:
                    torch._foreach_mul_([g for _, g in scaled], cached[2])
                folded, shared = cached[3], True
            else:  # per tensor (and the first step of "previous")
                factors = torch.clamp(self.max_grad_norm / (norms + EPS), max=1.0).to(dtype)
                if scaled:
                    some = factors if len(scaled) == len(group) else factors[[j for j, _ in scaled]]
                    torch._foreach_mul_([g for _, g in scaled], list(some.unbind()))
                folded, shared = factors.float(), False
            for j, (_, key) in enumerate(group):
                if key is not None:
                    factors_of[key] = (folded, 0 if shared else j)
        return factors_of

    def _global_norm(self) -> Optional[torch.Tensor]:
        """The 2-norm over this step's gradients so far; non-finite ones (skipped) do not count."""
        if self._exact_norm is not None:
            if not self._norms:
                return self._exact_norm
            self._norms.append(self._exact_norm.reshape(1))  # and gradients step() clipped after it: one sum
            self._exact_norm = None
        if not self._norms:
            return None
        device = self._norms[0].device
        norms = torch.cat([n.to(device) for n in self._norms])
        squares = torch.where(torch.isfinite(norms), norms * norms, torch.zeros_like(norms)).sum()
        if self.group is not None:  # FSDP2: local shards' squares summed over the ranks
            torch.distributed.all_reduce(squares, group=self.group)
        return torch.sqrt(squares)

    def before_step(self, params) -> None:
        """In ``step()``, before the update of the gradients still present: global clipping, or
        the release modes' rule for gradients that were not released (released ones still pending
        are updated first: a backward whose end was not seen, e.g. FSDP2's last hooks)."""
        self.flush()
        with_grad = [p for p in params if p.grad is not None]
        if not self.release and self.max_grad_norm is not None and self.clip_mode == "global" and with_grad:
            self.last_grad_norm = torch.nn.utils.clip_grad_norm_(with_grad, self.max_grad_norm, foreach=None)
            return
        if with_grad:
            self._clip([p.grad for p in with_grad])

    def norm_so_far(self) -> Optional[torch.Tensor]:
        """This step's global gradient norm over the gradients seen so far (pre-clip), else the
        last step's: what a framework's clipping call after backward would have returned."""
        self.flush()
        norm = self._global_norm()
        return norm if norm is not None else self.last_grad_norm

    def clip_state(self) -> dict:
        """What the next step's clipping depends on, for checkpoints: the last global norm as a
        float (read from the device: ``state_dict()`` synchronises once)."""
        return {} if self.last_grad_norm is None else {"last_grad_norm": float(self.last_grad_norm)}

    def load_clip_state(self, state: dict) -> None:
        """Restore :meth:`clip_state` (validated by the caller): the last norm, and the clip factor
        of the "previous" rule computed from it as ``after_step`` computes it."""
        self._norms, self._scaled, self._scale, self._exact_norm, self._partial = [], None, None, None, False
        norm = state.get("last_grad_norm")
        if norm is None:
            self.last_grad_norm = None
            return
        device = next((p.device for g in self.engine.inner.param_groups for p in g["params"]), torch.device("cpu"))
        self.last_grad_norm = torch.tensor(norm, dtype=torch.float32, device=device)
        self._set_scale()

    def _set_scale(self) -> None:
        """The "previous" rule's clip factor for the next step, from ``last_grad_norm``."""
        if self.max_grad_norm is not None and self._one_step_late:
            self._scale = torch.clamp(self.max_grad_norm / (self.last_grad_norm + EPS), max=1.0)
            self._scaled = None

    def after_step(self) -> None:
        """End of ``step()``: the step's global norm, and the next step's clip factor."""
        norm = self._global_norm()
        if norm is not None:
            # a non-finite exact norm (a NaN gradient, which skipped the step as global clipping
            # does) leaves the last finite one: no host synchronisation to ask
            keep = self.last_grad_norm if self.last_grad_norm is not None else norm.new_zeros(())
            self.last_grad_norm = torch.where(torch.isfinite(norm), norm, keep.to(norm.device))
            self._set_scale()
        self._norms, self._exact_norm, self._partial = [], None, False
        self.new_window()
        if self._order:
            self._last_order, self._order, self._staged_to = self._order, [], 0
            self.engine.schedule.staged_ahead = self.stage_next()  # the next step's first batch

    def new_window(self) -> None:
        """A step (or ``zero_grad()`` after a backward that did not step) ends the window: the next
        boundary backward releases every parameter again."""
        self.released = 0
        self._released_ids.clear()


def _norms_fp32(grads):
    """The 2-norm of each gradient, accumulated in fp32 (one foreach launch where torch has it)."""
    try:
        return list(torch._foreach_norm(grads, 2, dtype=torch.float32))
    except (TypeError, RuntimeError):  # a torch without the dtype argument, or a layout foreach does not take
        return [torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads]
