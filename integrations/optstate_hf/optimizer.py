"""The optimizer class the Trainer instantiates: ``optstate_core.OptStateAdamW`` + ``optim_args``."""
from __future__ import annotations

import optstate_core as oc

from .args import OptimArgs, parse_optim_args


class OptStateAdamW(oc.OptStateAdamW):
    """AdamW with virtualized state, built as ``cls(param_groups, **kwargs)`` by the Trainer.

    ``preset`` names an entry of ``optstate_core.PRESETS``; ``optim_args`` (a ``"k=v,..."``
    string, a mapping or an :class:`OptimArgs`) overrides it (see ``optstate_hf.args.KEYS``).
    Each instance builds its own policy, so one kwargs dict can build several optimizers.
    The Trainer's parameter groups (weight decay / no decay) are kept as given.
    """

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2,
                 amsgrad: bool = False, *, preset: str = "default", optim_args=None, **adamw_kwargs):
        options: OptimArgs = parse_optim_args(optim_args)
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                         policy=options.policy(preset), wrap_options=options.wrap_options(), **adamw_kwargs)


def optimizer_cls_and_kwargs(args, preset: str = "default", optim_args=None):
    """``(OptStateAdamW, kwargs)`` from ``TrainingArguments`` (lr, betas, eps, weight decay):
    what ``optim="optstate_adamw..."`` builds, for ``Trainer(optimizer_cls_and_kwargs=...)``.
    ``optim_args`` defaults to ``args.optim_args``; it is validated here."""
    options = parse_optim_args(args.optim_args if optim_args is None else optim_args)
    options.policy(preset)  # validate the preset and the policy arguments now, not at first step
    kwargs = {"lr": args.learning_rate, "betas": (args.adam_beta1, args.adam_beta2), "eps": args.adam_epsilon,
              "weight_decay": args.weight_decay, "preset": preset, "optim_args": options}
    return OptStateAdamW, kwargs
