"""Finding the optstate optimizer inside a prepared one; checking the accelerator argument."""
from __future__ import annotations

from accelerate import Accelerator

import optstate_core as oc

_MAX_NESTING = 8  # AcceleratedOptimizer -> (DeepSpeed/other wrappers) -> VirtualOptimizer


def unwrap_optimizer(optimizer) -> oc.VirtualOptimizer:
    """The :class:`optstate_core.VirtualOptimizer` inside ``optimizer`` (an ``AcceleratedOptimizer``
    or any wrapper exposing ``.optimizer``), or ``optimizer`` itself if it is one."""
    found = oc.unwrap(optimizer, _MAX_NESTING)
    if found is not None:
        return found
    raise ValueError(f"optimizer must be an optstate optimizer (optstate_core.wrap(...)) or a prepared one "
                     f"wrapping it; got {type(optimizer).__name__}")


def check_accelerator(accelerator) -> None:
    if not isinstance(accelerator, Accelerator):
        raise ValueError(f"accelerator must be an accelerate.Accelerator, got {type(accelerator).__name__}")
