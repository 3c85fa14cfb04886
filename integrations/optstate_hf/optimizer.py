"""The optimizer class the Trainer instantiates: ``optstate_core.OptStateAdamW`` + ``optim_args``."""
from __future__ import annotations

import logging

import optstate_core as oc

from .args import OptimArgs, parse_optim_args

log = logging.getLogger("optstate.hf")


class OptStateAdamW(oc.OptStateAdamW):
    """AdamW with virtualized state, built as ``cls(param_groups, **kwargs)`` by the Trainer.

    ``preset`` names an entry of ``optstate_core.PRESETS``; ``optim_args`` (a ``"k=v,..."``
    string, a mapping or an :class:`OptimArgs`) overrides it (see ``optstate_hf.args.KEYS``).
    Each instance builds its own policy, so one kwargs dict can build several optimizers.
    The Trainer's parameter groups (weight decay / no decay) are kept as given.
    """

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2,
                 amsgrad: bool = False, *, preset: str = "default", optim_args=None, max_grad_norm=None,
                 **adamw_kwargs):
        options: OptimArgs = parse_optim_args(optim_args)
        wrap_options = options.wrap_options()
        if max_grad_norm is not None:
            wrap_options["max_grad_norm"] = max_grad_norm
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                         policy=options.policy(preset), wrap_options=wrap_options, **adamw_kwargs)
        if self.release_gradients:  # release only on micro-batches that end in a step: Accelerate's flag
            from accelerate.state import GradientState
            state = GradientState()
            self.bind_step_boundary(lambda: bool(getattr(state, "sync_gradients", True)))


def optimizer_cls_and_kwargs(args, preset: str = "default", optim_args=None):
    """``(OptStateAdamW, kwargs)`` from ``TrainingArguments`` (lr, betas, eps, weight decay):
    what ``optim="optstate_adamw..."`` builds, for ``Trainer(optimizer_cls_and_kwargs=...)``.
    ``optim_args`` defaults to ``args.optim_args``; it is validated here."""
    options = parse_optim_args(args.optim_args if optim_args is None else optim_args)
    options.policy(preset)  # validate the preset and the policy arguments now, not at first step
    kwargs = {"lr": args.learning_rate, "betas": (args.adam_beta1, args.adam_beta2), "eps": args.adam_epsilon,
              "weight_decay": args.weight_decay, "preset": preset, "optim_args": options}
    if options.get("release_gradients"):
        kwargs["max_grad_norm"] = route_max_grad_norm(args)
    return OptStateAdamW, kwargs


def route_max_grad_norm(args, optimizer=None):
    """With released gradients the Trainer's own clipping (after backward) would see no gradient:
    take ``args.max_grad_norm`` for the optimizer (set on ``optimizer`` if given, which must not
    clip at another norm already) and turn the Trainer's clipping off. Returns the norm or None."""
    norm = args.max_grad_norm
    if norm is None or norm <= 0:
        return None
    if optimizer is not None:
        if optimizer.max_grad_norm is not None and optimizer.max_grad_norm != norm:
            raise ValueError(f"max_grad_norm: the Trainer clips at {norm} but the optimizer (release_gradients=True) "
                             f"at {optimizer.max_grad_norm}; set one of them")
        optimizer.max_grad_norm = norm
    args.max_grad_norm = 0.0
    log.info("optstate: gradients are released in backward; the Trainer's max_grad_norm=%s is applied by the "
             "optimizer (clip_mode=%s) and the Trainer's own clipping is off", norm,
             optimizer.clip_mode if optimizer is not None else "auto")
    return norm
