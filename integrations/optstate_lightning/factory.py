"""Build the callback and strategy classes for one Lightning package and register the strategies.

``lightning.pytorch`` and ``pytorch_lightning`` are separate packages with their own ``Callback``
and strategy classes and their own strategy registry, so each gets its own set of classes:
``optstate_lightning`` builds them for ``lightning.pytorch`` and ``optstate_lightning.pl`` for
``pytorch_lightning``. The classes are named after the module that exports them, so they pickle
(``ddp_spawn`` pickles the Trainer with its callbacks and strategy).
"""
from __future__ import annotations

import importlib
from types import SimpleNamespace

from .callback import CallbackLogic
from .strategies import DDPLogic, SingleDeviceLogic

#: registered name -> (strategy kind, fixed init arguments)
STRATEGY_NAMES = {
    "optstate": ("single", {}),
    "optstate_single_device": ("single", {}),
    "optstate_ddp": ("ddp", {"start_method": "popen"}),
    "optstate_ddp_spawn": ("ddp", {"start_method": "spawn"}),
    "optstate_ddp_fork": ("ddp", {"start_method": "fork"}),
}


def _named(cls: type, module: str) -> type:
    cls.__module__ = module
    cls.__qualname__ = cls.__name__
    return cls


def build(package: str, export_module: str) -> SimpleNamespace:
    """Classes for ``package`` (``"lightning.pytorch"`` or ``"pytorch_lightning"``), named as
    attributes of ``export_module``; registers the strategy names in that package's registry."""
    pl = importlib.import_module(package)
    strategies = importlib.import_module(f"{package}.strategies")
    core_optimizer = importlib.import_module(f"{package}.core.optimizer")

    callback_cls = _named(type("OptStateCallback", (CallbackLogic, pl.Callback), {
        "__doc__": f"Wraps every optimizer of a ``{package}`` Trainer with optstate (see optstate_lightning).",
        "_lightning_optimizer_cls": core_optimizer.LightningOptimizer,
        "_mock_optimizer_cls": core_optimizer._MockOptimizer,
    }), export_module)
    single_cls = _named(type("OptStateSingleDeviceStrategy", (SingleDeviceLogic, strategies.SingleDeviceStrategy), {
        "__doc__": "SingleDeviceStrategy whose optimizers are wrapped with optstate.",
        "strategy_name": "optstate_single_device",
        "_callback_cls": callback_cls,
    }), export_module)
    ddp_cls = _named(type("OptStateDDPStrategy", (DDPLogic, strategies.DDPStrategy), {
        "__doc__": "DDPStrategy whose optimizers are wrapped with optstate; ranks switch compression together.",
        "strategy_name": "optstate_ddp",
        "_callback_cls": callback_cls,
    }), export_module)

    classes = {"single": single_cls, "ddp": ddp_cls}
    for name, (kind, init_params) in STRATEGY_NAMES.items():
        strategies.StrategyRegistry.register(name, classes[kind], description=f"{classes[kind].__name__} ({name})",
                                             override=True, **init_params)
    return SimpleNamespace(OptStateCallback=callback_cls, OptStateSingleDeviceStrategy=single_cls,
                           OptStateDDPStrategy=ddp_cls, strategy_names=tuple(STRATEGY_NAMES))
