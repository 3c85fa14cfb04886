"""The optimizer classes the Trainer instantiates: AdamW, Lion or schedule-free AdamW wrapped with a
preset + ``optim_args``."""
from __future__ import annotations

import logging

import optstate_core as oc
from optstate_core.presets import with_stream

from .args import OptimArgs, parse_optim_args

log = logging.getLogger("optstate.hf")


class OptStateAdamW(oc.OptStateAdamW):
    """AdamW with virtualized state, built as ``cls(param_groups, **kwargs)`` by the Trainer.

    ``preset`` names an entry of ``optstate_core.PRESETS``, or one + ``-stream`` (the wrap option
    ``stream_weights=True``, which the callback starts); ``optim_args`` (a ``"k=v,..."``
    string, a mapping or an :class:`OptimArgs`) overrides it (see ``optstate_hf.args.KEYS``).
    Each instance builds its own policy, so one kwargs dict can build several optimizers.
    The Trainer's parameter groups (weight decay / no decay) are kept as given.
    """

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2,
                 amsgrad: bool = False, *, preset: str = "default", optim_args=None, max_grad_norm=None,
                 **adamw_kwargs):
        policy, wrap_options = _policy_and_options(preset, optim_args, max_grad_norm)
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                         policy=policy, wrap_options=wrap_options, **adamw_kwargs)
        _bind_release_boundary(self)


def _bind_release_boundary(optimizer) -> None:
    """Release only on micro-batches that end in a step: Accelerate's flag says which."""
    if optimizer.release_gradients:
        from accelerate.state import GradientState
        state = GradientState()
        optimizer.bind_step_boundary(lambda: bool(getattr(state, "sync_gradients", True)))


def _policy_and_options(preset: str, optim_args, max_grad_norm):
    """``(policy, wrap options)`` of a VirtualOptimizer from a preset, ``optim_args`` and the clipping norm."""
    options: OptimArgs = parse_optim_args(optim_args)
    preset, wrap_options = with_stream(preset, options.wrap_options())  # a -stream preset: stream_weights=True
    if max_grad_norm is not None:
        wrap_options["max_grad_norm"] = max_grad_norm
    return options.policy(preset), wrap_options


class OptStateLion(oc.VirtualOptimizer):
    """lion-pytorch's ``Lion`` with virtualized state (``optim="optstate_lion..."``), built as
    ``cls(param_groups, **kwargs)`` by the Trainer; betas are the Trainer's Adam betas."""

    def __init__(self, params, lr: float = 1e-4, betas=(0.9, 0.99), weight_decay: float = 0.0, *,
                 preset: str = "default", optim_args=None, max_grad_norm=None):
        try:
            from lion_pytorch import Lion
        except ImportError as e:
            raise ImportError("optim='optstate_lion...' needs lion-pytorch: pip install lion-pytorch "
                              "(or optstate[thirdparty])") from e
        policy, wrap_options = _policy_and_options(preset, optim_args, max_grad_norm)
        super().__init__(Lion(params, lr=lr, betas=betas, weight_decay=weight_decay), policy, **wrap_options)
        _bind_release_boundary(self)


class OptStateScheduleFreeAdamW(oc.VirtualOptimizer):
    """schedulefree's ``AdamWScheduleFree`` with virtualized state (``optim="optstate_schedule_free_adamw..."``):
    the Trainer's lr, betas, eps, weight decay and ``warmup_steps``, as its own ``schedule_free_adamw``.
    The Trainer calls its ``train()``/``eval()``; they run on the decoded state."""

    def __init__(self, params, lr: float = 0.0025, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 warmup_steps: int = 0, *, preset: str = "default", optim_args=None, max_grad_norm=None):
        try:
            from schedulefree import AdamWScheduleFree
        except ImportError as e:
            raise ImportError("optim='optstate_schedule_free_adamw...' needs schedulefree: pip install schedulefree "
                              "(or optstate[thirdparty])") from e
        policy, wrap_options = _policy_and_options(preset, optim_args, max_grad_norm)
        inner = AdamWScheduleFree(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                  warmup_steps=warmup_steps)
        super().__init__(inner, policy, **wrap_options)


CLASSES = {"adamw": OptStateAdamW, "lion": OptStateLion, "schedule_free_adamw": OptStateScheduleFreeAdamW}


def optimizer_cls_and_kwargs(args, preset: str = "default", optim_args=None, family: str = "adamw", model=None):
    """``(class, kwargs)`` from ``TrainingArguments`` (lr, betas, eps, weight decay; schedule-free:
    ``warmup_steps`` too): what ``optim="optstate_adamw..."`` (``family="adamw"``), ``"optstate_lion..."``
    (``"lion"``) or ``"optstate_schedule_free_adamw..."`` (``"schedule_free_adamw"``) builds, for
    ``Trainer(optimizer_cls_and_kwargs=...)``. ``optim_args`` defaults to ``args.optim_args``; it is
    validated here. ``preset="auto"`` plans for ``model`` now (:func:`optstate_hf.auto.resolve`); a preset
    ending in ``-stream`` wraps with ``stream_weights=True`` (``optim="optstate_adamw_..._stream"``)."""
    if family not in CLASSES:
        raise ValueError(f"family must be one of {', '.join(CLASSES)}, got {family!r}")
    options = parse_optim_args(args.optim_args if optim_args is None else optim_args)
    if preset == "auto":
        from .auto import resolve
        preset, options = resolve(args, model, options, family)
    _, wrap_options = with_stream(preset, options.wrap_options())  # -stream (and optim_args agree)
    options.policy(preset)  # validate the preset and the policy arguments now, not at first step
    kwargs = {"lr": args.learning_rate, "betas": (args.adam_beta1, args.adam_beta2), "weight_decay": args.weight_decay,
              "preset": preset, "optim_args": options}
    if family != "lion":
        kwargs["eps"] = args.adam_epsilon
    if family == "schedule_free_adamw":  # release_gradients is refused by the wrapper (stepped in one call)
        kwargs["warmup_steps"] = args.warmup_steps
    if wrap_options.get("release_gradients", wrap_options.get("stream_weights")):  # streaming releases too
        kwargs["max_grad_norm"] = route_max_grad_norm(args)
    return CLASSES[family], kwargs


def route_max_grad_norm(args, optimizer=None):
    """With released gradients the Trainer's own clipping (after backward) would see no gradient:
    take ``args.max_grad_norm`` for the optimizer (set on ``optimizer`` if given, which must not
    clip at another norm already) and turn the Trainer's clipping off. Returns the norm or None."""
    norm = args.max_grad_norm
    if norm is None or norm <= 0:
        return None
    if optimizer is not None:
        optimizer.take_over_clipping(norm, source="max_grad_norm (TrainingArguments)")
    args.max_grad_norm = 0.0
    log.info("optstate: gradients are released in backward; the Trainer's max_grad_norm=%s is applied by the "
             "optimizer (clip_mode=%s) and the Trainer's own clipping is off", norm,
             optimizer.clip_mode if optimizer is not None else "auto")
    return norm
