"""optstate for torchtitan: its optimizers' state compressed and/or offloaded.

Enable it with torchtitan's override mechanism (0.3.0)::

    --override.imports optstate_torchtitan.optstate_optimizers
    --override.imports 'optstate_torchtitan.optstate_optimizers={"preset": "4bit"}'

The override replaces the trainer's ``OptimizersContainer.Config`` (and any subclass) by
:class:`OptstateOptimizersContainer.Config`, whose ``build()`` makes the same torch optimizers,
each wrapped by ``optstate_core.wrap``. The override's keyword arguments set the config keys
(``preset`` -> ``optimizer.optstate_preset``, ``release_gradients``, ``max_grad_norm``,
``clip_mode``; any other keyword goes to ``optstate_core.wrap``). In a Python config (a
``config_registry`` function) the same is ``optimizer=optstate_optimizers(default_adamw(lr=3e-4),
preset="4bit")``, and then ``--optimizer.optstate_preset`` works on the command line as well.
"""
from __future__ import annotations

from dataclasses import fields

from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.config import derive, override

from .container import OptstateOptimizersContainer, create_state, unflatten

__all__ = ["OptstateOptimizersContainer", "optstate_optimizers", "create_state", "unflatten"]

_KEYS = ("preset", "release_gradients", "max_grad_norm", "clip_mode")


@override(target=OptimizersContainer.Config,
          description="optstate: each optimizer's state compressed/offloaded (optstate_core.wrap)")
def optstate_optimizers(cfg: OptimizersContainer.Config, **keys) -> OptstateOptimizersContainer.Config:
    """``cfg`` as an :class:`OptstateOptimizersContainer.Config`: its param groups and
    implementation kept, the optstate keys from ``keys`` (``preset``, ``release_gradients``,
    ``max_grad_norm``, ``clip_mode``; other keywords are options of ``optstate_core.wrap``), the
    rest from ``cfg`` when it is one already, else the defaults."""
    deltas = {f"optstate_{k}": keys.pop(k) for k in _KEYS if k in keys}
    if keys:
        own = {f.name for f in fields(OptstateOptimizersContainer.Config)}
        clash = sorted(k for k in keys if k in own or f"optstate_{k}" in own)
        if clash:
            raise TypeError(f"optstate_optimizers: {clash} are config fields, not options of optstate_core.wrap")
        base = getattr(cfg, "optstate_wrap_options", {})
        deltas["optstate_wrap_options"] = {**base, **keys}
    return derive(cfg, OptstateOptimizersContainer.Config, **deltas)
