"""VirtualOptimizer: any torch optimizer, with its state compressed and/or offloaded."""
from __future__ import annotations

import logging
from typing import Callable, Optional

import torch

from .state import checkpoint, master_weights
from . import metrics
from .schedule import pin_ahead
from .step.kernels import compile_ahead
from .schedule import weight_stream
from .schedule.engine import Engine
from .schedule.park import PhaseSwitch
from .policy import Policy, named_parameter_names
from .options import WrapOptions
from .preset_table import default_policy
from .schedule.release import check_clip_options
from .schedule.release_params import follow_parameters
from .step.session import install_session_methods
from .step.wrappable import check_wrappable, warn_about_checkpoint_overrides
from .state.store import ParamState

_SEEDS_KEY = "_optstate_master_seeds"  # in a pickled or copied wrapper's state (see __getstate__)
log = logging.getLogger("optstate")


class VirtualOptimizer(PhaseSwitch, torch.optim.Optimizer):
    """Wraps ``optimizer``; keeps its state in the form ``policy`` chooses between steps.

    It *is* a ``torch.optim.Optimizer`` that shares the inner optimizer's ``param_groups``
    (the same list of the same dicts) and ``defaults``, so LR schedulers, GradScaler,
    Accelerate and Lightning see a single optimizer. ``step(closure)`` runs the closure once
    (under ``torch.enable_grad()``), updates, and returns the closure's value.

    Options, as keywords or as one :class:`~optstate_core.options.WrapOptions` (``options``; keywords
    given beside it override its values), validated in one place (a bad value raises a
    ``ValueError`` naming it); ``named_parameters``: ``model.named_parameters()`` or the model, for
    name-based rules and messages.
        chunk_bytes: bound on the full-precision state materialized at once during ``step``
            (an int or a string such as ``"64MB"``; default 64 MiB). Large parameters are
            stepped in tiles so the bound holds for any tensor size.
        chunk_size: at most this many tiles per chunk (torch-optstate's count of parameters).
        initial_chunk_size: a smaller count for the first chunk of the first step.
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
        fused: use the fused Triton kernels where they apply (None: automatically on CUDA;
            True: also on the CPU under ``TRITON_INTERPRET=1``; False: never).
        fast_math: the fused Adam update's square root and reciprocal square root: the hardware's
            approximations (a few ulp, faster; the default, or ``OPTSTATE_FAST_MATH``) or, with
            ``False``, correctly rounded ones.
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
            ``release_gradients=True``). Allocated during
            backward in slabs and handed back after the step's write-backs; not part of ``gpu_budget``.
        observe_closure_loss: feed the closure's loss to a policy that wants it (default). An
            integration that feeds a better signal (window mean, all-reduced) turns this off.
        profile: log each step's timings (``last_step_timings``) at INFO level on the
            ``"optstate"`` logger (they are collected either way).
        release_gradients: on the micro-batch that ends in a step (see :meth:`set_step_boundary`),
            update each parameter in its post-accumulate-grad hook and free its gradient at
            once; ``step()`` then only advances the step. One process or FSDP2, no
            GradScaler (unscaling happens in ``step()``); see :mod:`optstate_core.schedule.release`.
            Default: on with ``stream_weights``, else off.
        release_bucket_bytes: released gradients wait until this many bytes of them are pending
            (and at the end of backward), then one launch updates them all (default 256MiB; 0:
            each parameter in its own hook). A byte count or a string ("64MB").
        max_grad_norm: clip gradients to this 2-norm before the update (None: no clipping).
        clip_mode: ``"auto"`` (``"global"`` without release; with it the exact global norm when
            one batch holds every gradient, else per tensor), ``"global"`` (torch's
            ``clip_grad_norm_`` over all gradients in ``step()``), ``"previous"`` (the exact norm
            when one batch holds the step, else the previous step's global norm) or ``"per_tensor"``.
        tuning: implementation choices of speed and memory (a compiled CPU step may round a few ulp
            differently): a :class:`~optstate_core.tuning.Tuning`, or a dict of its fields, e.g.
            ``{"stage_ahead": 0, "pinned_slab_bytes": 0}``: the CPU fast path and when it compiles,
            pinning and compiling ahead, prefetch and pinned slab sizes, release's staging depth,
            the fused kernels' launch shapes. A field not given takes its ``OPTSTATE_*`` variable,
            read here (docs/environment.md), else its measured default; ``memory_report()["options"]``
            shows the values used. An unknown field raises a ``TypeError``, a bad value a ``ValueError``.
        stream_weights: the model's decoder layers are to stream from host memory (turns gradient release
            on; a preset name ending in ``-stream`` sets it): :meth:`stream_weights` (or an integration's
            callback) starts it with the model, and an update before it starts raises, changing nothing.
        offload_activations: with ``stream_weights``, the layer inputs that activation checkpointing keeps
            go to host memory between forward and recompute (:func:`optstate_core.offload_activations`).

    Older spellings still work, with a ``DeprecationWarning`` (:data:`optstate_core.options.ALIASES`):
    ``elementwise`` (``granularity``), ``prefetch_during_backward`` (``prefetch_budget``) and
    torch-optstate's ``chunk_size_on_cuda`` (``chunk_size``).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, policy: Optional[Policy] = None,
                 options: Optional[WrapOptions] = None, *, named_parameters=None, **option_values):
        if isinstance(optimizer, VirtualOptimizer):
            raise ValueError("optimizer is already a VirtualOptimizer; wrap the inner optimizer once")
        check_wrappable(optimizer)
        if policy is None:
            policy = default_policy()
        if not isinstance(policy, Policy):
            raise ValueError(f"policy must be an optstate_core.Policy, got {type(policy).__name__}")
        options = WrapOptions.build(optimizer, options, **option_values)
        names = named_parameter_names(named_parameters) if named_parameters is not None else {}
        policy.bind_optimizer(optimizer)  # last check: its codecs may depend on the optimizer's class

        engine = Engine(optimizer, policy, options, names)
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
        install_session_methods(engine.ctx, engine.tiled, engine.sync_transfers)  # train(), eval(), ...: decoded state
        warn_about_checkpoint_overrides(optimizer)
        if options.release_gradients:  # hooks on every parameter (without release: when offloaded state is planned)
            follow_parameters(engine, defer_data_parallel=True)
        if existing:  # state made before wrapping: adopt it, then store it as the policy says
            engine.state.update({p: (ParamState(s) if isinstance(p, torch.Tensor) else s) for p, s in existing.items()})
            with torch.no_grad():
                engine.conform()
        else:  # offloaded state's pinned memory: pinned on a thread while the first forward runs
            pin_ahead.start(engine)
        if engine.fused.mode is not False and engine.kernels.compile_ahead:
            compile_ahead.start(optimizer)  # the first step's step-count kernels: compiled on a thread (CUDA)

    # -- torch.optim.Optimizer API -------------------------------------------------------------
    def step(self, closure: Optional[Callable[[], float]] = None):
        """One optimizer step; the closure (if any) runs once, with gradients enabled."""
        self._engine.clip_release.check_streaming()  # stream_weights=True without a stream: nothing changed
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        engine = self._engine
        if loss is not None and engine.policy.wants_loss and engine.observe_closure_loss:
            engine.policy.observe_loss(float(loss.detach() if isinstance(loss, torch.Tensor) else loss))
        with torch.no_grad():
            clipping = engine.clip_release
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
        if engine.options.profile:
            log.info("optstate: step %d: %s", engine.step_count, engine.metrics.as_dict())
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
        if self._engine.clip_release.release:
            follow_parameters(self._engine)

    def add_param_group(self, param_group: dict) -> None:
        engine = self.__dict__.get("_engine")
        if engine is None:  # called by Optimizer.__init__ with the inner's groups: shared, not copied
            return
        engine.inner.add_param_group(param_group)
        if engine.clip_release.release:
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
        return self._engine.clip_release.release

    @property
    def max_grad_norm(self) -> Optional[float]:
        """The clipping norm (None: no clipping); integrations route their clipping setting here."""
        return self._engine.clip_release.max_grad_norm

    @max_grad_norm.setter
    def max_grad_norm(self, value) -> None:
        gr = self._engine.clip_release
        gr.max_grad_norm, _ = check_clip_options(value, gr.clip_mode, gr.release)
        self._set_option(max_grad_norm=gr.max_grad_norm)

    def _set_option(self, **values) -> None:
        """Record an option changed after wrap() (``options`` and ``memory_report()`` show it)."""
        self._engine.replace_options(**values)

    def stream_weights(self, model, *, layers=None, prefetch: int = 1, offload_activations: Optional[bool] = None):
        """Keep the weights of ``model``'s decoder layers (the children of its largest
        ``nn.ModuleList``, or ``layers``) in host memory, brought to the device for each layer's
        forward, recompute and backward and written back after its update in backward (needs
        ``release_gradients=True``, which the wrap option ``stream_weights=True`` turns on; bit for bit
        the same training; one stream at a time, kept as :attr:`weight_stream`; ``release_bucket_bytes`` is
        lowered to the smallest layer's bytes, so each layer goes home once updated). ``prefetch``:
        layers copied in ahead of the one running. Returns the :class:`~optstate_core.schedule.weight_stream.WeightStream`
        (``close()`` ends it; ``gathered()`` holds every layer on the device for a block).
        ``offload_activations`` (None: the wrap option): the layers' checkpointed inputs go to host memory too."""
        engine = self._engine
        owned = {id(p) for p, _ in engine.param_infos()}
        offload = self.options.offload_activations if offload_activations is None else offload_activations
        stream = weight_stream.start(model, engine.clip_release, engine.boundary, owned, layers, prefetch, offload)
        layer_bytes = min(layer.bytes for layer in stream.layers)
        if self.options.release_bucket_bytes > layer_bytes:  # a layer goes home as soon as it is updated
            log.info("optstate: release_bucket_bytes %d -> %d (a streamed layer's gradients)",
                     self.options.release_bucket_bytes, layer_bytes)
            engine.clip_release.bucket_bytes = layer_bytes
            self._set_option(release_bucket_bytes=layer_bytes)
        return stream

    @property
    def weight_stream(self):
        """The :class:`~.schedule.weight_stream.WeightStream` that :meth:`stream_weights` started (None before)."""
        return self._engine.clip_release.stream

    def take_over_clipping(self, max_norm, *, norm_type: float = 2.0, source: str = "max_grad_norm",
                           check_only: bool = False) -> bool:
        """A framework's gradient clipping, handed to this optimizer: with gradient release the
        framework's clipping after backward would see no gradient, so the optimizer clips at
        ``max_norm`` instead and this returns True (the framework must turn its own off). Another
        ``norm_type``, or another norm set here already, raises a ``ValueError`` naming ``source``
        (the framework's setting) and changes nothing; ``check_only``: only check. Without release
        it returns False and changes nothing: the framework clips as usual."""
        gr = self._engine.clip_release
        if not gr.release or max_norm is None:
            return False
        if float(norm_type) != 2.0:
            raise ValueError(f"{source}: norm_type={norm_type} cannot be applied with release_gradients=True "
                             "(gradients are applied and freed in backward); the optimizer clips 2-norms")
        if gr.max_grad_norm is not None and gr.max_grad_norm != max_norm:
            raise ValueError(f"{source}={max_norm} but the optimizer (release_gradients=True) clips at "
                             f"max_grad_norm={gr.max_grad_norm}; set one of them")
        norm, _ = check_clip_options(max_norm, gr.clip_mode, gr.release)  # validates, names max_grad_norm
        if not check_only:
            self.max_grad_norm = norm
        return True

    @property
    def grad_norm_so_far(self) -> Optional[torch.Tensor]:
        """With gradient release: the global 2-norm of this step's gradients released so far
        (before clipping); None when nothing computed it."""
        return self._engine.clip_release.norm_so_far()

    @property
    def clip_mode(self) -> str:
        return self._engine.clip_release.clip_mode

    @property
    def last_grad_norm(self) -> Optional[torch.Tensor]:
        """The global 2-norm of the last step's gradients before clipping (None before the first
        step, or when neither clipping nor release computed it)."""
        return self._engine.clip_release.last_grad_norm

    # -- optstate API ---------------------------------------------------------------------------
    @property
    def options(self):
        """The validated :class:`~optstate_core.options.WrapOptions` this optimizer was built with."""
        return self._engine.options

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
        """Bytes held per tier and per codec, bits/param, the last step's timings and the options."""
        report = metrics.memory_report(self._engine, self.param_groups)
        report["options"] = self._engine.options.as_dict()
        return report

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
        self._set_option(observe_closure_loss=enabled)

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
