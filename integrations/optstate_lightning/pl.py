"""optstate for the ``pytorch_lightning`` package: the same names as ``optstate_lightning``.

``pytorch_lightning`` has its own ``Callback`` class and strategy registry, so use these with
``import pytorch_lightning as pl``; importing this module registers the ``optstate*`` strategy
names in ``pytorch_lightning``'s registry.
"""
from __future__ import annotations

from .config import OptStateConfig
from .factory import STRATEGY_NAMES, build

__all__ = ["OptStateCallback", "OptStateSingleDeviceStrategy", "OptStateDDPStrategy", "OptStateConfig",
           "STRATEGY_NAMES"]

_classes = build("pytorch_lightning", __name__)
OptStateCallback = _classes.OptStateCallback
OptStateSingleDeviceStrategy = _classes.OptStateSingleDeviceStrategy
OptStateDDPStrategy = _classes.OptStateDDPStrategy
