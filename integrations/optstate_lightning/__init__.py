"""optstate for Lightning: ``OptStateCallback`` and registered strategies.

``optstate_lightning`` targets ``lightning.pytorch`` (``import lightning``);
``optstate_lightning.pl`` offers the same names for the ``pytorch_lightning`` package.
Importing either registers the strategy names ``optstate`` / ``optstate_single_device``,
``optstate_ddp``, ``optstate_ddp_spawn`` and ``optstate_ddp_fork`` in that package's registry,
so import it before building the ``Trainer``::

    import lightning as L
    from optstate_lightning import OptStateCallback

    trainer = L.Trainer(callbacks=[OptStateCallback(policy="8bit")], accumulate_grad_batches=4)
    trainer = L.Trainer(strategy="optstate_ddp", devices=2)
"""
from __future__ import annotations

from .config import OptStateConfig

__all__ = ["OptStateCallback", "OptStateSingleDeviceStrategy", "OptStateDDPStrategy", "OptStateConfig",
           "STRATEGY_NAMES"]

from .factory import STRATEGY_NAMES

try:
    import lightning.pytorch  # noqa: F401
except ImportError:  # only pytorch_lightning (use optstate_lightning.pl), or neither
    _classes = None
else:
    from .factory import build as _build

    _classes = _build("lightning.pytorch", __name__)
    OptStateCallback = _classes.OptStateCallback
    OptStateSingleDeviceStrategy = _classes.OptStateSingleDeviceStrategy
    OptStateDDPStrategy = _classes.OptStateDDPStrategy


def __getattr__(name: str):
    if name in __all__:
        raise ImportError(f"optstate_lightning.{name} needs the 'lightning' package (pip install lightning); "
                          f"for the 'pytorch_lightning' package use optstate_lightning.pl.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
