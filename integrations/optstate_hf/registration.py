"""Make ``TrainingArguments(optim="optstate_adamw...")`` valid and dispatchable.

transformers 5.x validates ``optim`` with the str Enum ``OptimizerNames`` and dispatches through
the dict ``transformers.trainer_optimizer._OPTIMIZER_HANDLERS`` (name -> handler returning
``(optimizer_cls, kwargs)``). An Enum cannot be subclassed once it has members, so each name is
added as a new member of ``OptimizerNames`` and its handler put in that dict. transformers 4.x
has no handler dict; there :func:`register` raises :class:`RegistrationError` (use
``Trainer(optimizer_cls_and_kwargs=...)`` instead).
"""
from __future__ import annotations

import logging
from enum import Enum
from typing import Dict

log = logging.getLogger("optstate.hf")

#: ``optim`` name -> preset name in ``optstate_core.PRESETS``.
OPTIM_NAMES: Dict[str, str] = {
    "optstate_adamw": "default",
    "optstate_adamw_8bit": "8bit",
    "optstate_adamw_4bit": "4bit",
    "optstate_adamw_offload": "offload",
}


class RegistrationError(RuntimeError):
    """The installed transformers offers no way to register an ``optim`` name."""


def _handler_registry() -> dict:
    import transformers

    try:
        from transformers.trainer_optimizer import _OPTIMIZER_HANDLERS
    except ImportError:
        _OPTIMIZER_HANDLERS = None
    if not isinstance(_OPTIMIZER_HANDLERS, dict):
        raise RegistrationError(
            f"transformers {transformers.__version__} has no optimizer handler registry "
            "(transformers.trainer_optimizer._OPTIMIZER_HANDLERS, transformers >= 5), so "
            "TrainingArguments(optim='optstate_adamw') cannot be supported. Pass the optimizer instead: "
            "Trainer(..., optimizer_cls_and_kwargs=optstate_hf.optimizer_cls_and_kwargs(args, preset='default'))")
    return _OPTIMIZER_HANDLERS


def add_enum_member(enum_cls, name: str, value: str):
    """Add ``name = value`` to an existing (str) Enum, as its class statement would have; idempotent."""
    existing = enum_cls._value2member_map_.get(value)
    if existing is not None:
        return existing
    if name in enum_cls._member_map_:
        raise RegistrationError(f"{enum_cls.__name__}.{name} exists with another value")
    member = str.__new__(enum_cls, value)
    member._name_ = name
    member._value_ = value
    member.__objclass__ = enum_cls
    member._sort_order_ = len(enum_cls._member_names_)
    if hasattr(enum_cls, "_add_member_"):  # Python >= 3.13
        enum_cls._add_member_(name, member)
    else:
        type.__setattr__(enum_cls, name, member)
        enum_cls._member_map_[name] = member
    enum_cls._member_names_.append(name)
    enum_cls._value2member_map_[value] = member
    return member


def _make_handler(preset: str):
    def handler(ctx):
        from .optimizer import optimizer_cls_and_kwargs

        return optimizer_cls_and_kwargs(ctx.args, preset=preset, optim_args=ctx.optim_args)

    handler.__name__ = handler.__qualname__ = f"optstate_handler_{preset}"
    return handler


def register() -> None:
    """Register every name of :data:`OPTIM_NAMES` (idempotent). Raises RegistrationError on
    a transformers without the handler registry (4.x)."""
    from transformers.training_args import OptimizerNames

    if not (isinstance(OptimizerNames, type) and issubclass(OptimizerNames, Enum)):
        raise RegistrationError("transformers.training_args.OptimizerNames is not an Enum")
    handlers = _handler_registry()
    for optim, preset in OPTIM_NAMES.items():
        member = add_enum_member(OptimizerNames, optim.upper(), optim)
        handlers[member] = _make_handler(preset)
    log.debug("registered optim names %s", ", ".join(OPTIM_NAMES))


def is_registered() -> bool:
    """Whether ``optim="optstate_adamw"`` is valid for the installed transformers now."""
    from transformers.training_args import OptimizerNames

    try:
        return all(name in OptimizerNames._value2member_map_ and name in _handler_registry()
                   for name in OPTIM_NAMES)
    except RegistrationError:
        return False
