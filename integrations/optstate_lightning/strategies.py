"""The strategies' behaviour, written once for both Lightning packages.

A strategy wraps the optimizers right where they are made (``setup_optimizers``) and makes
sure the Trainer has an OptStateCallback for the training-time work (step boundaries, the
loss signal, metrics): the user's, if one was passed, else one built from the strategy's own
settings. The factory mixes these classes into ``SingleDeviceStrategy`` and ``DDPStrategy``.
"""
from __future__ import annotations

import logging
from typing import Any, Optional

import torch

from .config import PolicySpec

log = logging.getLogger("optstate.lightning")


class StrategyLogic:
    """Set by the factory: ``_callback_cls``, the package's OptStateCallback class."""

    _callback_cls: type

    def _init_optstate(self, policy: PolicySpec, log_metrics: bool, log_prefix: str,
                       wrap_options: Optional[dict]) -> None:
        if wrap_options is not None and not isinstance(wrap_options, dict):
            raise ValueError(f"wrap_options must be a dict or None, got {type(wrap_options).__name__}")
        self._optstate_callback = self._callback_cls(policy, log_metrics=log_metrics, log_prefix=log_prefix,
                                                     **(wrap_options or {}))

    def _optstate_callback_for(self, trainer):
        """The Trainer's OptStateCallback; this strategy's own is added when there is none."""
        for cb in trainer.callbacks:
            if isinstance(cb, self._callback_cls):
                if cb is not self._optstate_callback:
                    log.info("optstate: using the Trainer's OptStateCallback settings (%s)", cb.config.describe())
                return cb
        # First, so it feeds the policy before a ModelCheckpoint saves in the same hook.
        trainer.callbacks.insert(0, self._optstate_callback)
        return self._optstate_callback

    def setup_optimizers(self, trainer) -> None:
        super().setup_optimizers(trainer)
        self._optstate_callback_for(trainer).wrap_optimizers(trainer, self.lightning_module)


class SingleDeviceLogic(StrategyLogic):
    """One device. Built from a string (``strategy="optstate"``) the device is the one the
    Trainer's ``accelerator``/``devices`` select (Lightning hands it over as ``parallel_devices``)."""

    def __init__(self, device: Any = None, accelerator=None, checkpoint_io=None, precision_plugin=None, *,
                 policy: PolicySpec = None, log_metrics: bool = True, log_prefix: str = "optstate/",
                 wrap_options: Optional[dict] = None):
        super().__init__(device="cpu" if device is None else device, accelerator=accelerator,
                         checkpoint_io=checkpoint_io, precision_plugin=precision_plugin)
        self._device_given = device is not None
        self._parallel_devices = None
        self._init_optstate(policy, log_metrics, log_prefix, wrap_options)

    @property
    def parallel_devices(self):
        return self._parallel_devices

    @parallel_devices.setter
    def parallel_devices(self, devices) -> None:
        devices = list(devices or [])
        if len(devices) > 1:
            raise ValueError(f"devices: the optstate single-device strategy runs on one device, got {len(devices)}; "
                             "use strategy='optstate_ddp' for several")
        self._parallel_devices = devices
        if devices and not self._device_given:
            self._root_device = torch.device(devices[0])


class DDPLogic(StrategyLogic):
    """DistributedDataParallel; every other argument is ``DDPStrategy``'s."""

    def __init__(self, *args: Any, policy: PolicySpec = None, log_metrics: bool = True,
                 log_prefix: str = "optstate/", wrap_options: Optional[dict] = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._init_optstate(policy, log_metrics, log_prefix, wrap_options)
