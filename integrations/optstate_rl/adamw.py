"""``optstate_rl.AdamW``: the class RL frameworks load by dotted path."""
from __future__ import annotations

import optstate_core as oc

from .hooks import install_hooks

#: torch.optim.AdamW's own options (the others go to the wrapper: gpu_budget, release_gradients, fused, ...)
ADAMW_OPTIONS = ("amsgrad", "maximize", "foreach", "capturable", "differentiable")


def _flag(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return value


class AdamW(oc.OptStateAdamW):
    """``torch.optim.AdamW`` wrapped by optstate with ``preset`` (default ``"8bit"``): a
    ``VirtualOptimizer``, hence a ``torch.optim.Optimizer`` for LR schedulers and checkpoints.

    Built as the frameworks call it, ``AdamW(params, lr=..., weight_decay=..., betas=..., **extra)``
    (verl: ``extra`` is ``optim.override_optimizer_config``; NeMo-RL: ``policy.optimizer.kwargs``).
    Numbers given as strings by a config ("1e-8") and betas given as a list are accepted.
    ``amsgrad``, ``maximize``, ``foreach``, ``capturable`` and ``differentiable`` go to
    ``torch.optim.AdamW``; any other keyword to :class:`optstate_core.VirtualOptimizer`
    (``gpu_budget``, ``fused``, ``release_gradients``, ...).

    ``prepare_park`` (default True): pin the phase switch's host buffers on a thread after the
    first step, so the first park is as fast as the later ones (``VirtualOptimizer.prepare_park``:
    they hold as much page-locked host memory as the state holds on the GPU).
    ``framework_hooks`` (default True): route the offload helpers of verl and NeMo-RL to
    ``offload()``/``reload()`` (:func:`~optstate_rl.install_hooks`).
    """

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.01,
                 preset: str = "8bit", *, prepare_park: bool = True, framework_hooks: bool = True, **options):
        prepare_park, framework_hooks = _flag("prepare_park", prepare_park), _flag("framework_hooks", framework_hooks)
        betas = tuple(float(b) for b in betas)
        if len(betas) != 2:
            raise ValueError(f"betas must be two numbers, got {betas!r}")
        adamw = {k: options.pop(k) for k in ADAMW_OPTIONS if k in options}
        super().__init__(params, lr=float(lr), betas=betas, eps=float(eps), weight_decay=float(weight_decay),
                         preset=str(preset), wrap_options=options, **adamw)
        if prepare_park:
            self.prepare_park()
        if framework_hooks:
            install_hooks()
