"""optstate's ``optim`` names for the HF Trainer, and the import hook that makes them valid without
``import optstate_hf``.

Installing optstate puts ``optstate_hf_names.pth`` into site-packages (the wheel carries it;
an editable install gets it from ``python -m optstate_hf_names install``, which quickstart runs).
Python executes its one line at every interpreter start, torchrun and ``accelerate launch`` workers
included; the line calls :func:`install_hook`, which puts a finder in front of ``sys.meta_path``
and imports nothing else. The finder wraps two modules' loaders:

- ``transformers.training_args``: once it has executed, every name of :data:`OPTIM_NAMES` is added
  to its ``OptimizerNames`` enum, so ``TrainingArguments(optim="optstate_adamw")``, argument parsers
  and unpickled ``training_args.bin`` accept them (this module's code only: no torch, no optstate);
- ``transformers.trainer``: once it has executed, ``optstate_hf`` is imported, which registers the
  dispatch (``Trainer.get_optimizer_cls_and_kwargs``) and attaches ``OptStateCallback`` to a Trainer
  that creates its optimizer from one of these names (``optstate_hf.registration``).

``OPTSTATE_HF_AUTOREGISTER=0`` (read when the ``.pth`` line runs) leaves the hook out; ``import
optstate_hf`` registers the names as before. Standard library only, and nothing imported at start:
this module is imported by every Python process of an environment where optstate is installed.
"""
from __future__ import annotations

import os
import sys
from typing import Dict, Tuple

ENV = "OPTSTATE_HF_AUTOREGISTER"
#: the ``.pth`` file (beside this module: the source that setup.py and ``python -m optstate_hf_names
#: install`` copy into site-packages)
PTH_NAME = "optstate_hf_names.pth"

#: the names of ``optstate_core.PRESETS``, for this hook alone: it runs before (and without) torch and
#: optstate_core, so it cannot read the table. ``optstate_hf.registration`` generates its names from the
#: table itself, and tests/integrations/test_hf_registration.py checks that this tuple equals its keys.
PRESET_NAMES = ("fp32", "bf16", "8bit", "4bit", "offload", "4bit-all",
                "bf16w-8bit", "bf16w-8bit-lean", "bf16w-8bit-lean-hostcorr", "bf16w-8bit-lean-offload",
                "bf16w-4bit", "bf16w-4bit-lean", "bf16w-4bit-lean-hostcorr", "bf16w-4bit-lean-offload",
                "8bit-it24", "4bit-it24", "default")
#: the preset picked per model and device (``optstate_core.apps.auto``): AdamW only, ``optstate_adamw_auto``
AUTO = "auto"
#: name prefix -> the inner optimizer it builds: every preset exists for AdamW, lion-pytorch's Lion and
#: schedulefree's AdamWScheduleFree (``optstate_lion_8bit``: Lion with the ``8bit`` preset)
FAMILIES = {"optstate_adamw": "adamw", "optstate_lion": "lion", "optstate_schedule_free_adamw": "schedule_free_adamw"}
#: ``optstate_core``'s preset suffix for the weights streamed (``stream_weights=True``): AdamW's names have it
#: too (``optstate_adamw_bf16w_4bit_lean_stream``), but for the ``-it24`` presets (schedule-free's iterate)
STREAM = "-stream"


def optim_name(prefix: str, preset: str) -> str:
    """``optstate_adamw`` for ``default``, else the prefix, ``_`` and the preset with ``-`` as ``_``
    (``bf16w-4bit-lean`` -> ``optstate_adamw_bf16w_4bit_lean``); ``default-stream`` -> ``optstate_adamw_stream``."""
    stream = preset.endswith(STREAM)
    base = preset[:-len(STREAM)] if stream else preset
    name = prefix if base == "default" else f"{prefix}_{base.replace('-', '_')}"
    return name + ("_stream" if stream else "")


def optim_names(presets) -> Tuple[Dict[str, str], Dict[str, str]]:
    """``({optim name: preset}, {optim name: family})`` for every family and preset of ``presets``,
    ``optstate_adamw_auto``, and AdamW's ``-stream`` presets (``optstate_adamw..._stream``)."""
    names: Dict[str, str] = {}
    family_of: Dict[str, str] = {}
    for prefix, family in FAMILIES.items():
        for preset in list(presets) + ([AUTO] if family == "adamw" else []):
            name = optim_name(prefix, preset)
            names[name], family_of[name] = preset, family
    for preset in presets:
        if not preset.endswith("-it24"):
            name = optim_name("optstate_adamw", preset + STREAM)
            names[name], family_of[name] = preset + STREAM, "adamw"
    return names, family_of


#: ``optim`` name -> preset name in ``optstate_core.PRESETS`` (or ``auto``), and -> its family
OPTIM_NAMES, FAMILY_OF = optim_names(PRESET_NAMES)

_OFF = ("0", "false", "no", "off")


class RegistrationError(RuntimeError):
    """The installed transformers offers no way to register an ``optim`` name."""


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


def is_str_enum(cls) -> bool:
    from enum import Enum  # imported by transformers anyway; not at interpreter start

    return isinstance(cls, type) and issubclass(cls, Enum) and issubclass(cls, str)


def add_names(enum_cls, names=None) -> None:
    """Every name of ``names`` (default :data:`OPTIM_NAMES`) as a member of transformers'
    ``OptimizerNames`` (idempotent)."""
    for optim in OPTIM_NAMES if names is None else names:
        add_enum_member(enum_cls, optim.upper(), optim)


def enabled(environ=None) -> bool:
    """Whether the hook may be installed: ``OPTSTATE_HF_AUTOREGISTER`` is not ``0``/``false``/``no``/``off``."""
    value = (os.environ if environ is None else environ).get(ENV, "1")
    return value.strip().lower() not in _OFF


def _warn(what: str, error: BaseException) -> None:
    import logging

    logging.getLogger("optstate.hf").warning(
        "optstate: %s (%s: %s); `import optstate_hf` registers the optim names explicitly, %s=0 turns "
        "this hook off", what, type(error).__name__, error, ENV)


def _after_training_args(module) -> None:
    try:
        names = getattr(module, "OptimizerNames", None)
        if is_str_enum(names):
            add_names(names)
        # otherwise a transformers whose names cannot be extended: `import optstate_hf` says so
    except Exception as e:  # never break the user's import of transformers
        _warn("could not add the optim names to transformers' OptimizerNames", e)


def _after_trainer(module) -> None:
    try:
        import optstate_hf  # noqa: F401  (registers the dispatch and the callback; warns if it cannot)
    except Exception as e:
        _warn("import optstate_hf failed after transformers.trainer, so optim='optstate_...' is not dispatched", e)


#: module name -> what runs right after that module's code has executed
AFTER = {"transformers.training_args": _after_training_args, "transformers.trainer": _after_trainer}


class _Loader:
    """The module's own loader, with ``after(module)`` run once its code has executed."""

    def __init__(self, loader, after):
        self._loader, self._after = loader, after

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        self._after(module)

    def __getattr__(self, name):  # get_source, get_resource_reader, is_package, ...
        return getattr(self._loader, name)


class PostImportFinder:
    """A ``sys.meta_path`` finder that answers only for the modules of :data:`AFTER`, with the spec the
    other finders give, its loader wrapped by :class:`_Loader`."""

    def find_spec(self, fullname, path=None, target=None):
        after = AFTER.get(fullname)
        if after is None:
            return None
        for finder in sys.meta_path:
            if finder is self or isinstance(finder, PostImportFinder) or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module") or isinstance(spec.loader, _Loader):
            return spec
        spec.loader = _Loader(spec.loader, after)
        return spec


def install_hook(environ=None) -> bool:
    """Install the finder (what the ``.pth`` line calls); idempotent. Modules of :data:`AFTER` that are
    already imported get their step now. Returns False, changing nothing, when
    ``OPTSTATE_HF_AUTOREGISTER`` turns it off."""
    if not enabled(environ):
        return False
    if not any(isinstance(finder, PostImportFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, PostImportFinder())
    for name, after in AFTER.items():
        module = sys.modules.get(name)
        if module is not None and not getattr(getattr(module, "__spec__", None), "_initializing", False):
            after(module)
    return True


def is_hooked() -> bool:
    """Whether this process runs the hook (the ``.pth`` line ran and the environment allowed it)."""
    return any(isinstance(finder, PostImportFinder) for finder in sys.meta_path)
