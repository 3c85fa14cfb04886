"""VirtualOptimizer: any torch optimizer, with its state compressed and/or offloaded."""
from __future__ import annotations

import logging
from typing import Callable, Optional

import torch

from .state import checkpoint, master_weights
from . import metrics
from .schedule import pin_ahead
from .step.kernels import compile_ahead
from .schedule.engine import Engine
from .schedule.park import PhaseSwitch
from .policy import Policy, default_policy, named_parameter_names
from .schedule.prefetch import AUTO, check_prefetch_budget
from .schedule.release import DEFAULT_BUCKET_BYTES, GradientRelease, check_clip_options
from .schedule.release_params import follow_parameters
from .step.granularity import resolve as resolve_granularity
from .step.session import install_session_methods
from .step.wrappable import check_wrappable, warn_about_checkpoint_overrides
from .state.store import ParamState
from .state.units import parse_bytes

_SEEDS_KEY = "_optstate_master_seeds"  # in a pickled or copied wrapper's state (see __getstate__)
log = logging.getLogger("optstate")

DEFAULT_CHUNK_BYTES = 64 * 2**20


def _check_optional_int(name: str, value, minimum: int = 1) -> Optional[int]:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be None or an int >= {minimum}, got {value!r}")
    return value


class VirtualOptimizer(PhaseSwitch, torch.optim.Optimizer):
    """Wraps ``optimizer``; keeps its state in the form ``policy`` chooses between steps.

    It *is* a ``torch.optim.Optimizer`` that shares the inner optimizer's ``param_groups``
    (the same list of the same dicts) and ``defaults``, so LR schedulers, GradScaler,
    Accelerate and Lightning see a single optimizer. ``step(closure)`` runs the closure once
    (under ``torch.enable_grad()``), updates, and returns the closure's value.

    Options:
        chunk_bytes: bound on the full-precision state materialized at once during ``step``
            (an int or a string such as ``"64MB"``; default 64 MiB). Large parameters are
            stepped in tiles so the bound holds for any tensor size.
        chunk_size: at most this many tiles per chunk (torch-optstate's count of parameters).
        initial_chunk_size: a smaller count for the first chunk of the first step.
        chunk_size_on_cuda: torch-optstate compatibility: ``chunk_size`` when params are on CUDA.
        pin_memory: pin host-tier state (default: when parameters are on CUDA).
        skip_nonfinite: a NaN/inf gradient value never reaches a parameter or a state, and
            the event is counted (default True): the fused kernels leave the 256-element block
            holding it untouched, torch's fused Adam/AdamW on fp32 state skips its whole call,
            the reference path the parameter (README: NaN/inf gradients). ``False`` behaves
            like torch.
        check_in_backward: with ``skip_nonfinite``, check the CUDA gradients of fp32 state stepped
            by torch's fused Adam/AdamW for NaN/inf during backward, on a side stream, instead
            of reading them once more in the step (default False: the step gets faster, a
            training iteration did not reliably; README: NaN/inf gradients).
        seed: seed of the counter-based hash used by stochastic rounding.
        granularity: which subsets of its parameters the optimizer may be called on:
            ``"elementwise"`` (tiles of tensors), ``"tensor"`` (whole tensors, several calls a
            step) or ``"step"`` (one call over every parameter, so group values it keeps and
            reductions over all parameters match the unwrapped optimizer; the decoded state of
            every parameter is alive during that call). Default: the registry's entry for the
            optimizer's class (:mod:`optstate_core.step.granularity`), else ``"step"``. A choice
            finer than the registry's is checked on the first two steps against a whole step
            (on copies) and refused with a ``ValueError`` if they differ.
        elementwise: the older spelling: ``True`` is ``granularity="elementwise"``, ``False``
            ``"tensor"``.
        named_parameters: ``model.named_parameters()`` or the model, for name-based rules and
            messages.
        profile: accepted for torch-optstate compatibility (timings are always collected).
        fused: use the fused Triton kernels where they apply (None: automatically on CUDA;
            True: also on the CPU under ``TRITON_INTERPRET=1``; False: never).
        stochastic_param_rounding: on the fused path, round updated bf16 parameters
            stochastically (counter hash) instead of to nearest.
        gpu_budget: GPU memory the optimizer state may hold between steps (bytes, a string such
            as ``"2GB"``, or a fraction of the free GPU memory such as ``0.25``). State is kept
            resident beside the staging ring, the resident share spread evenly over the
            parameters in index order; the rest lives in pinned host memory and streams through
            the ring every step.
        offload: keep every state in (pinned) host memory and stream it each step.
        staging_bytes: size of the device ring that offloaded state streams through (default
            256 MB, at most half the budget); a chunk is at most half the ring.
        prefetch_budget: device memory that offloaded state may take while it uploads during
            backward (post-accumulate-grad hooks, on micro-batches that end in a step), so that
            its update runs at once in ``step()``: ``"auto"`` (on CUDA 0.9 of the memory the
            first measured backward freed, see :mod:`optstate_core.schedule.prefetch`; the ring alone
            until then), a byte count (``"2GB"``), or ``0`` (off: all offloaded state streams
            through the staging ring in ``step()``). Default ``None``: ``"auto"`` (``0`` with
            ``prefetch_during_backward=False`` or ``release_gradients=True``). Allocated during
            backward in slabs and handed back after the step's write-backs; not part of ``gpu_budget``.
        prefetch_during_backward: superseded by ``prefetch_budget`` (kept working): ``False``
            means ``prefetch_budget=0``, ``True`` turns it on (``"auto"`` unless a budget is given).
        observe_closure_loss: feed the closure's loss to a policy that wants it (default). An
            integration that feeds a better signal (window mean, all-reduced) turns this off.
        release_gradients: on the micro-batch that ends in a step (see :meth:`set_step_boundary`),
            update each parameter in its post-accumulate-grad hook and free its gradient at
            once; ``step()`` then only advances the step. One process or FSDP2, no
            GradScaler (unscaling happens in ``step()``); see :mod:`optstate_core.schedule.release`.
        release_bucket_bytes: released gradients wait until this many bytes of them are pending
            (and at the end of backward), then one launch updates them all (default 256MiB; 0:
            each parameter in its own hook). A byte count or a string ("64MB").
        max_grad_norm: clip gradients to this 2-norm before the update (None: no clipping).
        clip_mode: ``"auto"`` (``"global"`` without release; with it the exact global norm when
            one batch holds every gradient, else per tensor), ``"global"`` (torch's
            ``clip_grad_norm_`` over all gradients in ``step()``), ``"previous"`` (the exact norm
            when one batch holds the step, else the previous step's global norm) or ``"per_tensor"``.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, policy: Optional[Policy] = None, *,
                 chunk_bytes=DEFAULT_CHUNK_BYTES, chunk_size: Optional[int] = None,
                 initial_chunk_size: Optional[int] = None, chunk_size_on_cuda: Optional[int] = None,
                 pin_memory: Optional[bool] = None, skip_nonfinite: bool = True, check_in_backward: bool = False,
                 seed: int = 0,
                 elementwise: Optional[bool] = None, granularity: Optional[str] = None, named_parameters=None, profile: bool = False,
                 observe_closure_loss: bool = True, fused: Optional[bool] = None,
                 stochastic_param_rounding: bool = False, gpu_budget=None, offload: bool = False,
                 staging_bytes="256MB", prefetch_budget=None, prefetch_during_backward: Optional[bool] = None,
                 release_gradients: bool = False, release_bucket_bytes=DEFAULT_BUCKET_BYTES,
                 max_grad_norm=None, clip_mode: str = "auto"):
        if isinstance(optimizer, VirtualOptimizer):
            raise ValueError("optimizer is already a VirtualOptimizer; wrap the inner optimizer once")
        check_wrappable(optimizer)
        if policy is None:
            policy = default_policy()
        if not isinstance(policy, Policy):
            raise ValueError(f"policy must be an optstate_core.Policy, got {type(policy).__name__}")
        chunk_bytes = parse_bytes(chunk_bytes, "chunk_bytes")
        chunk_size = _check_optional_int("chunk_size", chunk_size)
        initial_chunk_size = _check_optional_int("initial_chunk_size", initial_chunk_size)
        chunk_size_on_cuda = _check_optional_int("chunk_size_on_cuda", chunk_size_on_cuda)
        if pin_memory is not None and not isinstance(pin_memory, bool):
            raise ValueError(f"pin_memory must be None, True or False, got {pin_memory!r}")
        if not isinstance(skip_nonfinite, bool):
            raise ValueError(f"skip_nonfinite must be True or False, got {skip_nonfinite!r}")
        if not isinstance(check_in_backward, bool):
            raise ValueError(f"check_in_backward must be True or False, got {check_in_backward!r}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an int, got {seed!r}")
        if fused is not None and not isinstance(fused, bool):
            raise ValueError(f"fused must be None, True or False, got {fused!r}")
        if not isinstance(stochastic_param_rounding, bool):
            raise ValueError(f"stochastic_param_rounding must be True or False, got {stochastic_param_rounding!r}")
        if gpu_budget is not None:
            if isinstance(gpu_budget, float) and not isinstance(gpu_budget, bool):
                if not 0.0 < gpu_budget < 1.0:
                    raise ValueError(f"gpu_budget as a fraction must be in (0, 1), got {gpu_budget!r}")
                if not torch.cuda.is_available():
                    raise ValueError(f"gpu_budget={gpu_budget!r} is a fraction of free GPU memory, but CUDA is not "
                                     "available; give a byte count (e.g. '2GB') or leave it None")
            else:
                gpu_budget = parse_bytes(gpu_budget, "gpu_budget")
        staging_bytes = parse_bytes(staging_bytes, "staging_bytes")
        if not isinstance(offload, bool):
            raise ValueError(f"offload must be True or False, got {offload!r}")
        if prefetch_budget is None:  # on by default (docs/benchmarks-journal.md section 12: hides the transfers)
            prefetch_budget = 0 if prefetch_during_backward is False else AUTO
        else:
            prefetch_budget = check_prefetch_budget(prefetch_budget)
        if prefetch_during_backward is not None and not isinstance(prefetch_during_backward, bool):
            raise ValueError(f"prefetch_during_backward must be None, True or False, got {prefetch_during_backward!r}")
        if prefetch_during_backward is True and prefetch_budget == 0:
            raise ValueError("prefetch_during_backward=True contradicts prefetch_budget=0")
        if prefetch_during_backward is False:
            if prefetch_budget not in (0, AUTO):
                raise ValueError(f"prefetch_during_backward=False contradicts prefetch_budget={prefetch_budget!r}")
            prefetch_budget = 0
        if not isinstance(observe_closure_loss, bool):
            raise ValueError(f"observe_closure_loss must be True or False, got {observe_closure_loss!r}")
        if not isinstance(release_gradients, bool):
            raise ValueError(f"release_gradients must be True or False, got {release_gradients!r}")
        max_grad_norm, clip_mode = check_clip_options(max_grad_norm, clip_mode, release_gradients)
        release_bucket_bytes = parse_bytes(release_bucket_bytes, "release_bucket_bytes", allow_zero=True)
        if release_gradients and prefetch_budget == AUTO and not prefetch_during_backward:
            prefetch_budget = 0  # released parameters update in backward: nothing left to prefetch
        granularity, check_granularity = resolve_granularity(optimizer, granularity, elementwise)
        if release_gradients and granularity == "step":
            raise ValueError(f"release_gradients=True: {type(optimizer).__name__} is stepped in one call over every "
                             "parameter (granularity 'step': it is not known to update each parameter on its own), "
                             "so no parameter can be updated alone in its backward hook. Use it without release, "
                             "or pass granularity='elementwise'/'tensor' if its update is (checked on the first steps)")
        if chunk_size is None and chunk_size_on_cuda is not None and any(
                p.is_cuda for g in optimizer.param_groups for p in g["params"]):
            chunk_size = chunk_size_on_cuda
        names = named_parameter_names(named_parameters) if named_parameters is not None else {}
        policy.bind_optimizer(optimizer)  # last check: its codecs may depend on the optimizer's class

        engine = Engine(optimizer, policy, chunk_bytes=chunk_bytes, chunk_size=chunk_size,
                        initial_chunk_size=initial_chunk_size, pin_memory=pin_memory,
                        skip_nonfinite=skip_nonfinite, seed=seed, granularity=granularity, names=names,
                        fused=fused, stochastic_param_rounding=stochastic_param_rounding, gpu_budget=gpu_budget,
                        staging_bytes=staging_bytes, prefetch_budget=prefetch_budget,
                        check_granularity=check_granularity)
        engine.placement.offload_all = offload
        engine.check_in_backward = check_in_backward
        engine.gradient_release = GradientRelease(engine, release_gradients, max_grad_norm, clip_mode,
                                                  release_bucket_bytes)
        if release_gradients:
            engine.schedule.release = engine.gradient_release
        existing = dict(optimizer.state)
        self._engine = None  # add_param_group below must not touch the inner groups
        super().__init__(optimizer.param_groups, optimizer.defaults)
        # Share the inner optimizer's list of group dicts and its defaults: one optimizer.
        self.param_groups = optimizer.param_groups
        self.defaults = optimizer.defaults
        self.optimizer = optimizer
        self._engine = engine
        self.state = engine.state
        optimizer.state = engine.state
        engine.observe_closure_loss = observe_closure_loss
        install_session_methods(engine)  # train(), eval(), ...: they see their decoded state
        warn_about_checkpoint_overrides(optimizer)
        if release_gradients:  # hooks on every parameter (without release, when offloaded state is first planned)
            follow_parameters(engine, defer_data_parallel=True)
        if existing:  # state made before wrapping: adopt it, then store it as the policy says
            engine.state.update({p: (ParamState(s) if isinstance(p, torch.Tensor) else s) for p, s in existing.items()})
            with torch.no_grad():
                engine.conform()
        else:  # offloaded state's pinned memory: pinned on a thread while the first forward runs
            pin_ahead.start(engine)
        compile_ahead.start(engine)  # the first step's step-count kernels: compiled on a thread (CUDA)

    # -- torch.optim.Optimizer API -------------------------------------------------------------
    def step(self, closure: Optional[Callable[[], float]] = None):
        """One optimizer step; the closure (if any) runs once, with gradients enabled."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        engine = self._engine
        if loss is not None and engine.policy.wants_loss and engine.observe_closure_loss:
            engine.policy.observe_loss(float(loss.detach() if isinstance(loss, torch.Tensor) else loss))
        with torch.no_grad():
            clipping = engine.gradient_release
            if clipping.release or clipping.max_grad_norm is not None:
                params = [p for g in self.param_groups for p in g["params"]]
                if clipping.release and follow_parameters(engine, params):
                    log.warning("optstate: the parameters in param_groups were replaced after wrap() (an FSDP2 "
                                "prepare?): this step's gradients were not released in backward; later steps "
                                "release them. Call optimizer.rebind_parameters() after the framework's prepare to "
                                "release from the first step (OptStateCallback and optstate_accelerate.attach do)")
                clipping.before_step(params)
            engine.step()
            clipping.after_step()
        engine.inner._opt_called = True  # a scheduler built on the inner optimizer must not warn
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._engine.schedule.zero_grad()  # a backward without a step: its staged state is not used
        self._engine.inner.zero_grad(set_to_none=set_to_none)

    def rebind_parameters(self) -> None:
        """After a framework replaced the parameters in ``param_groups`` (FSDP2's prepare in Accelerate
        and the HF Trainer swaps in DTensor parameters): gradient release moves its backward hooks to
        them and finds their shards' process group. Without release, nothing to do. The
        integrations call it; step() does it too, one step late."""
        if self._engine.gradient_release.release:
            follow_parameters(self._engine)

    def add_param_group(self, param_group: dict) -> None:
        engine = self.__dict__.get("_engine")
        if engine is None:  # called by Optimizer.__init__ with the inner's groups: shared, not copied
            return
        engine.inner.add_param_group(param_group)
        if engine.gradient_release.release:
            follow_parameters(engine, defer_data_parallel=True)

    def _hooks(self, kind: str) -> list:
        """``(optimizer, hook)`` of one kind of state_dict hook: the wrapped optimizer's own on it first
        (a library's, e.g. heavyball's schedule stats), then the wrapper's (the user's)."""
        inner = self._engine.inner
        own, ours = getattr(inner, kind, None), getattr(self, kind)
        first = [(inner, h) for h in own.values()] if own and own is not ours else []
        return first + [(self, h) for h in ours.values()]

    def state_dict(self) -> dict:
        """Encoded state (tensors and primitives only), torch's group format, a format version."""
        for opt, hook in self._hooks("_optimizer_state_dict_pre_hooks"):
            hook(opt)
        out = checkpoint.build_state_dict(self._engine, self.param_groups)
        for opt, hook in self._hooks("_optimizer_state_dict_post_hooks"):
            result = hook(opt, out)
            if result is not None:
                out = result
        return out

    def load_state_dict(self, state_dict: dict) -> None:
        """Load our own format or a plain torch optimizer state_dict (migration)."""
        checkpoint.check_is_state_dict(state_dict)
        state_dict = dict(state_dict)
        for opt, hook in self._hooks("_optimizer_load_state_dict_pre_hooks"):
            result = hook(opt, state_dict)
            if result is not None:
                state_dict = result
        state_dict, masters = master_weights.prepare_load(self._engine, self.param_groups, state_dict)
        checkpoint.load_state_dict(self._engine, self.param_groups, state_dict)
        master_weights.apply_masters(self._engine, masters)
        for opt, hook in self._hooks("_optimizer_load_state_dict_post_hooks"):
            hook(opt)

    def export_state_dict(self, device="cpu") -> dict:
        """A plain torch state_dict (decoded state) that the unwrapped optimizer can load. With
        master weights it has one more entry, ``"master_weights"``: ``{parameter index: fp32
        master}`` (the correction itself is not exported); loading it back restores them."""
        exported = checkpoint.export_state_dict(self._engine, self.param_groups, device=device)
        return master_weights.export_masters(self._engine, self.param_groups, exported, device=device)

    def train(self, mode: bool = True):
        """The wrapped optimizer's ``train()`` (``eval()`` with ``mode=False``) when it has one
        (schedule-free optimizers), run on its decoded state; otherwise nothing."""
        fn = getattr(self._engine.inner, "train" if mode else "eval", None)
        if callable(fn):
            fn()
        return self

    def __getattr__(self, name: str):
        """Public attributes the wrapped optimizer has and the wrapper lacks (its own methods run on
        their decoded state). Private names are never forwarded: ``_step_supports_amp_scaling`` on
        a fused optimizer would make GradScaler hand its scale to the wrapper."""
        engine = self.__dict__.get("_engine")
        if engine is None or name.startswith("_"):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(engine.inner, name)

    def eval(self):
        return self.train(False)

    # -- offload()/reload()/parked(): the phase switch, in schedule/park.py -------------------------
    def close(self) -> None:
        """Release staging memory, pinned host buffers and all state; the optimizer is done.
        Save ``state_dict()`` first if you need it."""
        self._engine.close()

    # -- gradient release and clipping ------------------------------------------------------------
    @property
    def release_gradients(self) -> bool:
        """Whether gradients are applied and freed in backward (see the constructor option)."""
        return self._engine.gradient_release.release

    @property
    def max_grad_norm(self) -> Optional[float]:
        """The clipping norm (None: no clipping); integrations route their clipping setting here."""
        return self._engine.gradient_release.max_grad_norm

    @max_grad_norm.setter
    def max_grad_norm(self, value) -> None:
        gr = self._engine.gradient_release
        gr.max_grad_norm, _ = check_clip_options(value, gr.clip_mode, gr.release)

    @property
    def clip_mode(self) -> str:
        return self._engine.gradient_release.clip_mode

    @property
    def last_grad_norm(self) -> Optional[torch.Tensor]:
        """The global 2-norm of the last step's gradients before clipping (None before the first
        step, or when neither clipping nor release computed it)."""
        return self._engine.gradient_release.last_grad_norm

    # -- optstate API ---------------------------------------------------------------------------
    @property
    def policy(self) -> Policy:
        return self._engine.policy

    @property
    def step_count(self) -> int:
        return self._engine.step_count

    @property
    def last_step_timings(self) -> dict:
        return self._engine.metrics.as_dict()

    def memory_report(self) -> dict:
        """Bytes held per tier and per codec, bits/param, and the last step's timings."""
        return metrics.memory_report(self._engine, self.param_groups)

    def log_metrics(self, prefix: str = "optstate/") -> dict:
        """Flat float metrics for loggers: state MB per tier, bits/param, step and overhead ms."""
        return metrics.log_metrics(self.memory_report(), prefix)

    def set_step_boundary(self, will_step: bool) -> None:
        """Tell the engine whether the coming backward ends in an optimizer step (the last
        micro-batch of a gradient-accumulation window) or not. Backward-time prefetch of
        offloaded state only runs before a step (left at True, every micro-batch's backward
        may stage state, which then stays on the device until the step). Required for accumulation with
        ``release_gradients=True`` (a second backward before ``step()`` raises). Integrations call this for you."""
        self._engine.boundary.set(bool(will_step))

    @property
    def observe_closure_loss(self) -> bool:
        """Whether the closure's loss is fed to the policy (see the constructor option)."""
        return self._engine.observe_closure_loss

    @observe_closure_loss.setter
    def observe_closure_loss(self, enabled: bool) -> None:
        if not isinstance(enabled, bool):
            raise ValueError(f"observe_closure_loss must be True or False, got {enabled!r}")
        self._engine.observe_closure_loss = enabled

    @property
    def step_boundary(self) -> bool:
        """Whether the coming backward ends in an optimizer step (see :meth:`set_step_boundary`)."""
        return self._engine.boundary.will_step

    def bind_step_boundary(self, source: Optional[Callable[[], bool]]) -> None:
        """Read the step boundary from ``source()`` instead (e.g. Accelerate's ``sync_gradients``)."""
        if source is not None and not callable(source):
            raise ValueError("source must be a callable returning bool, or None")
        self._engine.boundary.source = source

    def observe_loss(self, loss) -> bool:
        """Feed a training loss to the policy; True when this call switched compression on."""
        return bool(self._engine.policy.observe_loss(float(loss.detach() if isinstance(loss, torch.Tensor) else loss)))

    def get_state(self, param: torch.Tensor) -> dict:
        """The decoded (full-precision) state of one parameter, as the inner optimizer sees it."""
        self._engine.sync_transfers()
        return checkpoint.decoded_param_state(self._engine.state.get(param, {}), param.device, param)

    def __getstate__(self):
        # the whole wrapper (torch's keeps only defaults, state and groups), and cast_model's
        # remainders of parameters not stepped yet: a copy's parameters are new objects
        seeds = master_weights.seeds_by_index(self._all_params())
        return {**self.__dict__, **({_SEEDS_KEY: seeds} if seeds else {})}

    def __setstate__(self, state):
        state = dict(state)
        seeds = state.pop(_SEEDS_KEY, None)
        super().__setstate__(state)
        if seeds:
            master_weights.restore_seeds(self._all_params(), seeds)

    def _all_params(self) -> list:
        return [p for g in self._engine.inner.param_groups for p in g["params"]]

    def __repr__(self) -> str:
        return f"VirtualOptimizer({self._engine.inner!r}, policy={self._engine.policy.describe()})"
