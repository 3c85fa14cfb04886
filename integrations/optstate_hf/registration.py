"""Make ``TrainingArguments(optim="optstate_adamw...")`` valid and dispatchable (transformers 4.46+ and 5.x).

Two steps, the same on every supported transformers:

- Validation: ``TrainingArguments.__post_init__`` runs ``OptimizerNames(self.optim)``, a str Enum
  that cannot be subclassed once it has members, so each name is added as a new member.
- Dispatch: ``Trainer.create_optimizer`` asks the public static method
  ``Trainer.get_optimizer_cls_and_kwargs(args, model)`` for ``(optimizer_cls, kwargs)``. In 4.x it is
  one long if/elif over the names, in 5.x a lookup in a private handler dict; both are reached
  through that method, so it is wrapped: our names are answered here, every other name goes to the
  original method unchanged. Subclasses (``Seq2SeqTrainer``, TRL's trainers) inherit the wrapper.

If the installed transformers lacks either hook, :func:`register` raises :class:`RegistrationError`
before changing anything (``Trainer(optimizer_cls_and_kwargs=...)`` still works there).
"""
from __future__ import annotations

import functools
import inspect
import logging
from enum import Enum
from typing import Callable, Dict

log = logging.getLogger("optstate.hf")

#: ``optim`` name -> preset name in ``optstate_core.PRESETS``.
OPTIM_NAMES: Dict[str, str] = {
    "optstate_adamw": "default",
    "optstate_adamw_8bit": "8bit",
    "optstate_adamw_4bit": "4bit",
    "optstate_adamw_offload": "offload",
    # bf16 parameters (load the model in bf16 or oc.cast_model it) + fp32 masters as state
    "optstate_adamw_bf16w_8bit": "bf16w-8bit",
    "optstate_adamw_bf16w_4bit": "bf16w-4bit",
    "optstate_adamw_bf16w_8bit_lean": "bf16w-8bit-lean",
    "optstate_adamw_bf16w_4bit_lean": "bf16w-4bit-lean",
    "optstate_adamw_bf16w_8bit_lean_hostcorr": "bf16w-8bit-lean-hostcorr",
    "optstate_adamw_bf16w_4bit_lean_hostcorr": "bf16w-4bit-lean-hostcorr",
    "optstate_adamw_bf16w_8bit_lean_offload": "bf16w-8bit-lean-offload",
    "optstate_adamw_bf16w_4bit_lean_offload": "bf16w-4bit-lean-offload",
}
#: ``optim`` name -> the inner optimizer it builds: every AdamW name also exists for lion-pytorch's
#: Lion and schedulefree's AdamWScheduleFree (``optstate_lion_8bit``: Lion with the ``8bit`` preset)
_ADAMW_NAMES = dict(OPTIM_NAMES)
FAMILY_OF: Dict[str, str] = dict.fromkeys(_ADAMW_NAMES, "adamw")
for _prefix, _family in (("optstate_lion", "lion"), ("optstate_schedule_free_adamw", "schedule_free_adamw")):
    for _adamw_name, _preset in _ADAMW_NAMES.items():
        _name = _prefix + _adamw_name[len("optstate_adamw"):]
        OPTIM_NAMES[_name], FAMILY_OF[_name] = _preset, _family

HOOK = "get_optimizer_cls_and_kwargs"
_FALLBACK = ("Pass the optimizer instead: Trainer(..., optimizer_cls_and_kwargs="
             "optstate_hf.optimizer_cls_and_kwargs(args, preset='default'))")


class RegistrationError(RuntimeError):
    """The installed transformers offers no way to register an ``optim`` name."""


def _version() -> str:
    import transformers

    return getattr(transformers, "__version__", "?")


def _optimizer_names():
    from transformers.training_args import OptimizerNames

    if not (isinstance(OptimizerNames, type) and issubclass(OptimizerNames, Enum) and issubclass(OptimizerNames, str)):
        raise RegistrationError(f"transformers {_version()}: transformers.training_args.OptimizerNames is not a str "
                                f"Enum, so optim names cannot be added. {_FALLBACK}")
    return OptimizerNames


def _dispatch_hook():
    """The Trainer class and its static ``get_optimizer_cls_and_kwargs(args, model=None)``."""
    from transformers import Trainer

    raw = Trainer.__dict__.get(HOOK)
    fn = raw.__func__ if isinstance(raw, staticmethod) else None
    params = list(inspect.signature(fn).parameters) if fn is not None else []
    if fn is None or params[:2] != ["args", "model"]:
        raise RegistrationError(
            f"transformers {_version()}: Trainer.{HOOK} is not the static method (args, model) that optstate_hf "
            f"wraps to dispatch optim='optstate_adamw...' (found {type(raw).__name__} with parameters {params}). "
            f"{_FALLBACK}")
    return Trainer, fn


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


def _wrap(original: Callable) -> Callable:
    @functools.wraps(original)
    def get_optimizer_cls_and_kwargs(args, model=None):
        optim = getattr(args.optim, "value", args.optim)
        preset = OPTIM_NAMES.get(optim)
        if preset is None:
            return original(args, model)
        from .optimizer import optimizer_cls_and_kwargs

        return optimizer_cls_and_kwargs(args, preset=preset, family=FAMILY_OF[optim])

    get_optimizer_cls_and_kwargs.optstate_original = original
    return get_optimizer_cls_and_kwargs


def register() -> None:
    """Register every name of :data:`OPTIM_NAMES` (idempotent). Raises RegistrationError, changing
    nothing, on a transformers without the two hooks."""
    names = _optimizer_names()
    trainer, fn = _dispatch_hook()
    for optim in OPTIM_NAMES:
        add_enum_member(names, optim.upper(), optim)
    if not hasattr(fn, "optstate_original"):
        setattr(trainer, HOOK, staticmethod(_wrap(fn)))
    log.debug("registered optim names %s (transformers %s)", ", ".join(OPTIM_NAMES), _version())


def is_registered() -> bool:
    """Whether ``optim="optstate_adamw"`` is valid and dispatched by the installed transformers now."""
    try:
        names = _optimizer_names()
        _, fn = _dispatch_hook()
    except RegistrationError:
        return False
    return hasattr(fn, "optstate_original") and all(name in names._value2member_map_ for name in OPTIM_NAMES)
