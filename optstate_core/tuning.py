"""Implementation knobs as one wrap() option, :class:`Tuning`, with the ``OPTSTATE_*`` environment as its defaults."""
from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, fields, replace
from typing import Dict, Mapping, Optional, Tuple

from .schedule import prefetch, release
from .state import pinned
from .state.units import parse_bytes
from .step import cpu_step, fused_launch

#: ``tuning.cpu_compile``: never compile, compile at a class's first call, or once it pays (the default)
CPU_COMPILE = ("auto", "never", "always")
#: ``OPTSTATE_CPU_COMPILE``'s spellings of them
CPU_COMPILE_ENV = {"0": "never", "1": "always", "auto": "auto"}
#: the launch shape's parts (``tuning.launch_shapes[kind]``), their variables and least values
SHAPE_PARTS = ("nblk", "num_warps", "iters", "maxnreg")
SHAPE_ENV = ("OPTSTATE_NBLK", "OPTSTATE_NUM_WARPS", "OPTSTATE_ITERS", "OPTSTATE_MAXNREG")
SHAPE_LEAST = (1, 1, 1, 0)


@dataclass(frozen=True)
class Tuning:
    """Implementation choices of one wrapped optimizer (``wrap(..., tuning=Tuning(...))`` or a dict of
    these fields). The defaults are the measured choices; each field left ``None`` takes its
    ``OPTSTATE_*`` environment variable, read at wrap() (docs/environment.md), else its default.

    * ``cpu_fast_path`` (``OPTSTATE_CPU_FAST``): the CPU fast path of Adam/AdamW on encoded state
      (``step/cpu_step.py``); False: every CPU update through the tiled reference path.
    * ``cpu_compile`` (``OPTSTATE_CPU_COMPILE``: 0/1/auto): when that path compiles a shape class:
      ``"never"``, ``"always"`` (at its first call) or ``"auto"`` (once its eager time reaches
      ``cpu_compile_after_s`` seconds, ``OPTSTATE_CPU_COMPILE_AFTER``).
    * ``cpu_batch`` (``OPTSTATE_CPU_BATCH``): row slices one compiled CPU call steps.
    * ``pin_ahead`` (``OPTSTATE_PIN_AHEAD``): pin the first step's host-tier state on a thread from wrap().
    * ``compile_ahead`` (``OPTSTATE_COMPILE_AHEAD``): compile Triton kernel variants on a thread ahead
      of their first launch.
    * ``prefetch_slab_bytes`` (``OPTSTATE_SLAB_MB``, in MiB there): queued bytes that start a
      backward-time prefetch upload.
    * ``pinned_slab_bytes`` (``OPTSTATE_PINNED_SLAB_BYTES``): the largest shared pinned slab; 0: a
      pinned allocation per state.
    * ``stage_ahead`` (``OPTSTATE_STAGE_AHEAD``): released batches of host state staged ahead of
      their update (0: none).
    * ``launch_shapes`` (``OPTSTATE_NBLK``, ``_NUM_WARPS``, ``_ITERS``, ``_MAXNREG``, each every kind's
      value): state kind (``int8``, ``int4``, ``other``) -> (NBLK, num_warps, ITERS, maxnreg) of the
      fused kernels; kinds not given keep ``fused_launch.LAUNCH_SHAPES``' (with the variables).

    A bad value raises a ``ValueError`` naming the field (a bad variable: naming the variable)."""

    cpu_fast_path: Optional[bool] = None
    cpu_compile: Optional[str] = None
    cpu_compile_after_s: Optional[float] = None
    cpu_batch: Optional[int] = None
    pin_ahead: Optional[bool] = None
    compile_ahead: Optional[bool] = None
    prefetch_slab_bytes: Optional[int] = None
    pinned_slab_bytes: Optional[int] = None
    stage_ahead: Optional[int] = None
    launch_shapes: Optional[Dict[str, Tuple[int, int, int, int]]] = None

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None:
                object.__setattr__(self, f.name, _CHECKS[f.name](f"tuning.{f.name}", value))

    @classmethod
    def from_env(cls, environ: Optional[Mapping[str, str]] = None) -> "Tuning":
        """Every field from its environment variable, else its default (``environ``: default this
        process's). The one place optstate reads these variables; called by wrap()."""
        env = os.environ if environ is None else environ  # the defaults: the modules' constants as they are now
        after = env.get("OPTSTATE_CPU_COMPILE_AFTER")
        shapes = {kind: tuple(_count(env, name, value, least)
                              for name, value, least in zip(SHAPE_ENV, shape, SHAPE_LEAST))
                  for kind, shape in fused_launch.LAUNCH_SHAPES.items()}  # as it is now: bench --tune changes it
        mib = _count(env, "OPTSTATE_SLAB_MB", 0, 1, "a positive integer (MiB per slab)")
        return cls(cpu_fast_path=env.get("OPTSTATE_CPU_FAST", "1") != "0",
                   cpu_compile=_choice(env, "OPTSTATE_CPU_COMPILE", "auto", CPU_COMPILE_ENV, "0, 1 or auto"),
                   cpu_compile_after_s=cpu_step.DEFAULT_COMPILE_AFTER if after is None else _seconds(after),
                   cpu_batch=_count(env, "OPTSTATE_CPU_BATCH", cpu_step.DEFAULT_BATCH, 1, "a positive integer"),
                   pin_ahead=_choice(env, "OPTSTATE_PIN_AHEAD", "1", {"0": False, "1": True}, "0 or 1"),
                   compile_ahead=_choice(env, "OPTSTATE_COMPILE_AHEAD", "1", {"0": False, "1": True}, "0 or 1"),
                   prefetch_slab_bytes=mib << 20 if mib else prefetch.SLAB_BYTES,
                   pinned_slab_bytes=_count(env, "OPTSTATE_PINNED_SLAB_BYTES", pinned.DEFAULT_SLAB_BYTES, 0,
                                            "an integer >= 0 (bytes of the largest shared slab; 0: none shared)"),
                   stage_ahead=_count(env, "OPTSTATE_STAGE_AHEAD", release.DEFAULT_STAGE_AHEAD, 0,
                                      "an integer >= 0 (0 turns staging off)"),
                   launch_shapes=shapes)

    @classmethod
    def resolve(cls, value=None, over: Optional["Tuning"] = None, environ=None) -> "Tuning":
        """Every field decided: ``value`` (a Tuning, a dict of fields or None) over ``over`` (the
        options' tuning, when keywords override a :class:`WrapOptions`), over :meth:`from_env`."""
        tuning = cls.coerce(value)
        if over is not None:
            tuning = tuning.over(cls.coerce(over))
        if any(getattr(tuning, f.name) is None for f in fields(cls)):
            tuning = tuning.over(cls.from_env(environ))
        return tuning

    @classmethod
    def coerce(cls, value) -> "Tuning":
        """``value`` as a Tuning: a Tuning, a dict of its fields (an unknown one: ``TypeError``) or None."""
        if value is None:
            return cls()
        if isinstance(value, Tuning):
            return value
        if not isinstance(value, Mapping):
            raise ValueError(f"tuning must be an optstate_core.Tuning, a dict of its fields or None, got {value!r}")
        names = [f.name for f in fields(cls)]
        unknown = sorted(set(value) - set(names))
        if unknown:
            raise TypeError(f"unknown tuning field(s) {', '.join(map(str, unknown))}; "
                            f"the fields are: {', '.join(names)}")
        return cls(**value)

    def over(self, base: "Tuning") -> "Tuning":
        """The fields set here, the others ``base``'s (launch shapes: per kind)."""
        values = {f.name: getattr(base, f.name) if getattr(self, f.name) is None else getattr(self, f.name)
                  for f in fields(self)}
        if self.launch_shapes is not None and base.launch_shapes is not None:
            values["launch_shapes"] = {**base.launch_shapes, **self.launch_shapes}
        return replace(base, **values)

    def as_dict(self) -> dict:
        return asdict(self)

    def __hash__(self):  # launch_shapes is a dict: hashed as its items (WrapOptions stays hashable)
        return hash(tuple((f.name, tuple(sorted(v.items())) if isinstance(v := getattr(self, f.name), dict) else v)
                          for f in fields(self)))


def fast_math_default(environ: Optional[Mapping[str, str]] = None) -> bool:
    """The ``fast_math`` option when not given: ``OPTSTATE_FAST_MATH`` (``1``, the default: hardware
    square root and reciprocal square root, a few ulp, in the Adam update; anything else: correctly
    rounded ones). Read at wrap()."""
    return (os.environ if environ is None else environ).get("OPTSTATE_FAST_MATH", "1") == "1"


# -- the environment's spellings ---------------------------------------------------------------
def _count(env, name: str, default: int, least: int, what: Optional[str] = None) -> int:
    """The integer variable ``name`` (at least ``least``), or ``default`` when unset; anything else
    is refused by name (``what``: how the error describes a valid value)."""
    value = env.get(name)
    if value is None:
        return default
    if not value.strip().isdigit() or int(value) < least:
        raise ValueError(f"{name} must be {what or f'an integer >= {least}'}, got {value!r}")
    return int(value)


def _choice(env, name: str, default: str, choices: dict, what: str):
    value = env.get(name, default).strip()
    if value not in choices:
        raise ValueError(f"{name} must be {what}, got {value!r}")
    return choices[value]


def _seconds(value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0 or seconds == math.inf:
        raise ValueError(f"OPTSTATE_CPU_COMPILE_AFTER must be a number of seconds >= 0, got {value!r}")
    return seconds


# -- the fields' checks (each returns the value as stored) ---------------------------------------
def _bool(name, value):
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return value


def _int(least):
    def check(name, value):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{name} must be an int >= {least}, got {value!r}")
        return value
    return check


def _compile(name, value):
    if value not in CPU_COMPILE:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, CPU_COMPILE))}, got {value!r}")
    return value


def _after(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
        raise ValueError(f"{name} must be a number of seconds >= 0, got {value!r}")
    return float(value)


def _shapes(name, value):
    kinds = tuple(fused_launch.LAUNCH_SHAPES)
    if not isinstance(value, Mapping):
        raise ValueError(f"{name} must be a dict of state kind ({', '.join(kinds)}) -> "
                         f"({', '.join(SHAPE_PARTS)}), got {value!r}")
    out = {}
    for kind, shape in value.items():
        if kind not in kinds:
            raise ValueError(f"{name}: unknown state kind {kind!r}; the kinds are: {', '.join(kinds)}")
        if not isinstance(shape, (tuple, list)) or len(shape) != len(SHAPE_PARTS) or not all(
                isinstance(v, int) and not isinstance(v, bool) and v >= least for v, least in zip(shape, SHAPE_LEAST)):
            raise ValueError(f"{name}[{kind!r}] must be ({', '.join(SHAPE_PARTS)}): ints >= "
                             f"{', '.join(map(str, SHAPE_LEAST))} (maxnreg 0: no cap), got {shape!r}")
        out[kind] = tuple(shape)
    return out


_CHECKS = {"cpu_fast_path": _bool, "cpu_compile": _compile, "cpu_compile_after_s": _after, "cpu_batch": _int(1),
           "pin_ahead": _bool, "compile_ahead": _bool,
           "prefetch_slab_bytes": lambda name, v: parse_bytes(v, name),
           "pinned_slab_bytes": lambda name, v: parse_bytes(v, name, allow_zero=True),
           "stage_ahead": _int(0), "launch_shapes": _shapes}
