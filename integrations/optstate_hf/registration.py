"""Make ``TrainingArguments(optim="optstate_adamw...")`` valid and dispatchable (transformers 4.46+ and 5.x).

Three steps, the same on every supported transformers:

- Validation: ``TrainingArguments.__post_init__`` runs ``OptimizerNames(self.optim)``, a str Enum
  that cannot be subclassed once it has members, so each name is added as a new member.
- Dispatch: ``Trainer.create_optimizer`` asks the public static method
  ``Trainer.get_optimizer_cls_and_kwargs(args, model)`` for ``(optimizer_cls, kwargs)``. In 4.x it is
  one long if/elif over the names, in 5.x a lookup in a private handler dict; both are reached
  through that method, so it is wrapped: our names are answered here, every other name goes to the
  original method unchanged. Subclasses (``Seq2SeqTrainer``, TRL's trainers) inherit the wrapper.
- The callback: ``Trainer.create_optimizer`` is wrapped too. When it has just created an optstate
  optimizer from one of these names, the Trainer gets an ``OptStateCallback`` unless it holds one
  (the Trainer creates its optimizer before ``on_train_begin``, where the callback binds the
  accumulation boundaries and, under FSDP2, rebinds release to the sharded parameters).

The names are generated from ``optstate_core.PRESETS`` (:func:`optstate_hf_names.optim_names`: one
per preset and family, ``optstate_adamw_auto``, and AdamW's ``..._stream`` names, whose preset ends in
``-stream``: the optimizer is wrapped with ``stream_weights=True`` and the callback streams the model).
The enum step lives in ``optstate_hf_names`` (standard library only), which the ``.pth`` hook of an
installed optstate runs when transformers is imported (with the table's preset names, which it cannot
import), and which imports this package once ``transformers.trainer`` has executed: the names then need
no ``import optstate_hf``.

If the installed transformers lacks the validation or dispatch hook, :func:`register` raises
:class:`RegistrationError` before changing anything (``Trainer(optimizer_cls_and_kwargs=...)`` still
works there); without ``create_optimizer`` the names still work, without the automatic callback.
"""
from __future__ import annotations

import functools
import inspect
import logging
from typing import Callable

import optstate_core as oc
from optstate_hf_names import RegistrationError, add_enum_member, add_names, is_str_enum, optim_names

__all__ = ["FAMILY_OF", "OPTIM_NAMES", "RegistrationError", "add_enum_member", "attach_callback", "is_registered",
           "register"]

log = logging.getLogger("optstate.hf")

#: ``optim`` name -> preset of ``optstate_core.PRESETS`` (or ``auto``), and -> the optimizer family it builds
OPTIM_NAMES, FAMILY_OF = optim_names(oc.PRESETS)

HOOK = "get_optimizer_cls_and_kwargs"
CREATE = "create_optimizer"
_FALLBACK = ("Pass the optimizer instead: Trainer(..., optimizer_cls_and_kwargs="
             "optstate_hf.optimizer_cls_and_kwargs(args, preset='default'))")


def _version() -> str:
    import transformers

    return getattr(transformers, "__version__", "?")


def _optimizer_names():
    from transformers.training_args import OptimizerNames

    if not is_str_enum(OptimizerNames):
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


def _wrap(original: Callable) -> Callable:
    @functools.wraps(original)
    def get_optimizer_cls_and_kwargs(args, model=None):
        optim = getattr(args.optim, "value", args.optim)
        preset = OPTIM_NAMES.get(optim)
        if preset is None:
            return original(args, model)
        from .optimizer import optimizer_cls_and_kwargs

        return optimizer_cls_and_kwargs(args, preset=preset, family=FAMILY_OF[optim], model=model)

    get_optimizer_cls_and_kwargs.optstate_original = original
    return get_optimizer_cls_and_kwargs


def attach_callback(trainer) -> bool:
    """Give ``trainer`` an ``OptStateCallback`` if its optimizer is an optstate optimizer it built from one
    of :data:`OPTIM_NAMES` (not one passed in, not ``optimizer_cls_and_kwargs``) and it holds none yet.
    Returns whether one was added."""
    optim = getattr(trainer.args.optim, "value", trainer.args.optim)
    if optim not in OPTIM_NAMES or getattr(trainer, "optimizer_cls_and_kwargs", None) is not None:
        return False
    from .callback import OptStateCallback, find_virtual_optimizer

    handler = getattr(trainer, "callback_handler", None)
    if handler is None or find_virtual_optimizer(getattr(trainer, "optimizer", None)) is None:
        return False
    if any(isinstance(callback, OptStateCallback) for callback in handler.callbacks):
        return False
    handler.add_callback(OptStateCallback())
    log.info("optstate: optim=%r: added OptStateCallback to the Trainer (accumulation boundaries, warmup "
             "switching, metrics; pass your own OptStateCallback(...) to configure it)", optim)
    return True


def _wrap_create(original: Callable) -> Callable:
    @functools.wraps(original)
    def create_optimizer(self, *args, **kwargs):
        creating = getattr(self, "optimizer", None) is None
        optimizer = original(self, *args, **kwargs)
        if creating:
            attach_callback(self)
        return optimizer

    create_optimizer.optstate_original = original
    return create_optimizer


def register() -> None:
    """Register every name of :data:`OPTIM_NAMES` (idempotent). Raises RegistrationError, changing
    nothing, on a transformers without the two hooks."""
    names = _optimizer_names()
    trainer, fn = _dispatch_hook()
    add_names(names, OPTIM_NAMES)
    if not hasattr(fn, "optstate_original"):
        setattr(trainer, HOOK, staticmethod(_wrap(fn)))
    create = trainer.__dict__.get(CREATE)
    if not inspect.isfunction(create):
        log.warning("optstate: transformers %s: Trainer.%s is not a method, so OptStateCallback is not added "
                    "automatically: pass callbacks=[optstate_hf.OptStateCallback()]", _version(), CREATE)
    elif not hasattr(create, "optstate_original"):
        setattr(trainer, CREATE, _wrap_create(create))
    log.debug("registered optim names %s (transformers %s)", ", ".join(OPTIM_NAMES), _version())


def is_registered() -> bool:
    """Whether ``optim="optstate_adamw"`` is valid and dispatched by the installed transformers now."""
    try:
        names = _optimizer_names()
        _, fn = _dispatch_hook()
    except RegistrationError:
        return False
    return hasattr(fn, "optstate_original") and all(name in names._value2member_map_ for name in OPTIM_NAMES)
