"""The wrapper's options as data: :class:`WrapOptions`, validated in one place, with the older
spellings mapped to the current ones through one deprecation path (:data:`ALIASES`)."""
from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, fields
from typing import Optional, Union

import torch

from .schedule.prefetch import AUTO, check_prefetch_budget
from .schedule.release import DEFAULT_BUCKET_BYTES, check_clip_options
from .state.units import parse_bytes
from .step.granularity import resolve as resolve_granularity
from .tuning import Tuning, fast_math_default

DEFAULT_CHUNK_BYTES = 64 * 2**20

#: older option names -> what to say instead; each still works, with a DeprecationWarning
ALIASES = {
    "elementwise": "granularity='elementwise' (True) or 'tensor' (False)",
    "prefetch_during_backward": "prefetch_budget ('auto' for True, 0 for False)",
    "chunk_size_on_cuda": "chunk_size (torch-optstate's spelling: chunk_size when the parameters are on CUDA; "
                          "optstate_core.auto_wrap and the wrap_*_adamw constructors take it as torch-optstate does)",
}


@dataclass(frozen=True)
class WrapOptions:
    """Every option of :class:`~optstate_core.optimizer.VirtualOptimizer` (its docstring says what
    each does), validated and resolved: byte sizes are ints, the granularity and the prefetch
    budget are decided. Build with :meth:`build`; ``memory_report()["options"]`` shows them."""

    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    chunk_size: Optional[int] = None
    initial_chunk_size: Optional[int] = None
    pin_memory: Optional[bool] = None
    skip_nonfinite: bool = True
    check_in_backward: bool = False
    seed: int = 0
    granularity: Optional[str] = None  # resolved against the optimizer by build()
    check_granularity: bool = False  # the user chose a granularity finer than the registry's
    fused: Optional[bool] = None
    fast_math: Optional[bool] = None  # resolved by build(): OPTSTATE_FAST_MATH when not given
    stochastic_param_rounding: bool = False
    observe_closure_loss: bool = True
    profile: bool = False
    gpu_budget: Union[int, float, None] = None
    offload: bool = False
    staging_bytes: int = 256 * 10**6  # "256MB"
    prefetch_budget: Union[int, str] = AUTO
    release_gradients: Optional[bool] = None  # resolved by build(): True with stream_weights, else False
    release_bucket_bytes: int = DEFAULT_BUCKET_BYTES
    max_grad_norm: Optional[float] = None
    clip_mode: str = "auto"
    tuning: Optional[Tuning] = None  # resolved by build(): the given fields over Tuning.from_env()
    stream_weights: bool = False  # the model's weights are to stream (VirtualOptimizer.stream_weights starts it)
    offload_activations: bool = False  # ... and the inputs checkpointing keeps go to host memory meanwhile

    @classmethod
    def build(cls, optimizer: torch.optim.Optimizer, options: Optional["WrapOptions"] = None,
              **kwargs) -> "WrapOptions":
        """Validate ``kwargs`` (over ``options``, if given) for ``optimizer``: a bad value raises a
        ``ValueError`` that names it, an unknown name a ``TypeError``."""
        if options is not None and not isinstance(options, WrapOptions):
            raise ValueError(f"options must be a WrapOptions or None, got {type(options).__name__}")
        names = {f.name for f in fields(cls)} - {"check_granularity"}
        unknown = sorted(set(kwargs) - names - set(ALIASES))
        if unknown:
            raise TypeError(f"unknown option(s) {', '.join(unknown)}; the options are: {', '.join(sorted(names))}")
        given = {} if options is None else {f.name: getattr(options, f.name) for f in fields(cls)}
        given.pop("check_granularity", None)
        if "tuning" in kwargs:  # keywords override the options' values; the tuning's field by field
            kwargs["tuning"] = Tuning.resolve(kwargs["tuning"], over=given.pop("tuning", None))
        aliases = {k: kwargs.pop(k) for k in list(kwargs) if k in ALIASES}
        for name in aliases:
            warnings.warn(f"optstate: the option {name} is deprecated; use {ALIASES[name]}", DeprecationWarning,
                          stacklevel=4)
        return cls(**_validated(optimizer, {**given, **kwargs}, aliases))

    def as_dict(self) -> dict:
        """The options as plain values (for ``memory_report()`` and logs)."""
        return dataclasses.asdict(self)


def _check_bool(name: str, value, optional: bool = False):
    if value is None and optional:
        return None
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be {'None, ' if optional else ''}True or False, got {value!r}")
    return value


def check_optional_int(name: str, value, minimum: int = 1) -> Optional[int]:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be None or an int >= {minimum}, got {value!r}")
    return value


def _gpu_budget(value):
    if value is None:
        return None
    if isinstance(value, float):
        if not 0.0 < value < 1.0:
            raise ValueError(f"gpu_budget as a fraction must be in (0, 1), got {value!r}")
        if not torch.cuda.is_available():
            raise ValueError(f"gpu_budget={value!r} is a fraction of free GPU memory, but CUDA is not "
                             "available; give a byte count (e.g. '2GB') or leave it None")
        return value
    return parse_bytes(value, "gpu_budget")


def _release(release, stream: bool) -> bool:
    """``release_gradients``: None is ``stream_weights`` (streamed layers update in backward); False with it raises."""
    _check_bool("release_gradients", release, optional=True)
    if stream and release is False:
        raise ValueError("release_gradients=False contradicts stream_weights=True: streamed weights are updated in "
                         "backward, by gradient release (leave release_gradients out, or set it True)")
    return stream if release is None else release


def _prefetch_budget(budget, during_backward, release: bool):
    """The prefetch budget from ``prefetch_budget`` and the older ``prefetch_during_backward``."""
    _check_bool("prefetch_during_backward", during_backward, optional=True)
    if budget is None:  # on by default: hides the transfers (docs/offload.md)
        budget = 0 if during_backward is False else AUTO
    else:
        budget = check_prefetch_budget(budget)
    if during_backward is True and budget == 0:
        raise ValueError("prefetch_during_backward=True contradicts prefetch_budget=0")
    if during_backward is False:
        if budget not in (0, AUTO):
            raise ValueError(f"prefetch_during_backward=False contradicts prefetch_budget={budget!r}")
        budget = 0
    if release and budget == AUTO and not during_backward:
        budget = 0  # released parameters update in backward: nothing left to prefetch
    return budget


def _validated(optimizer, kw: dict, aliases: dict) -> dict:
    """The checked and resolved values of every option: those given, else the dataclass defaults."""
    out = {**{f.name: f.default for f in fields(WrapOptions)}, **kw}
    for name in ("chunk_bytes", "staging_bytes"):
        out[name] = parse_bytes(out[name], name)
    for name in ("chunk_size", "initial_chunk_size"):
        out[name] = check_optional_int(name, out[name])
    on_cuda = check_optional_int("chunk_size_on_cuda", aliases.get("chunk_size_on_cuda"))
    if out["chunk_size"] is None and on_cuda is not None and any(
            p.is_cuda for g in optimizer.param_groups for p in g["params"]):
        out["chunk_size"] = on_cuda
    for name in ("pin_memory", "fused", "fast_math"):
        out[name] = _check_bool(name, out[name], optional=True)
    if out["fast_math"] is None:
        out["fast_math"] = fast_math_default()
    out["tuning"] = Tuning.resolve(out["tuning"])
    for name in ("skip_nonfinite", "check_in_backward", "offload", "stochastic_param_rounding",
                 "observe_closure_loss", "profile", "stream_weights", "offload_activations"):
        out[name] = _check_bool(name, out[name])
    if out["offload_activations"] and not out["stream_weights"]:
        raise ValueError("offload_activations=True needs stream_weights=True (it starts with the stream); without "
                         "streaming call optstate_core.offload_activations(model)")
    out["release_gradients"] = _release(out["release_gradients"], out["stream_weights"])
    if isinstance(out["seed"], bool) or not isinstance(out["seed"], int):
        raise ValueError(f"seed must be an int, got {out['seed']!r}")
    out["gpu_budget"] = _gpu_budget(out["gpu_budget"])
    release = out["release_gradients"]
    out["prefetch_budget"] = _prefetch_budget(kw.get("prefetch_budget"), aliases.get("prefetch_during_backward"),
                                              release)
    out["max_grad_norm"], out["clip_mode"] = check_clip_options(out["max_grad_norm"], out["clip_mode"], release)
    out["release_bucket_bytes"] = parse_bytes(out["release_bucket_bytes"], "release_bucket_bytes", allow_zero=True)
    granularity, out["check_granularity"] = resolve_granularity(optimizer, out["granularity"],
                                                                aliases.get("elementwise"))
    if release and granularity == "step":
        raise ValueError(f"release_gradients=True: {type(optimizer).__name__} is stepped in one call over every "
                         "parameter (granularity 'step': it is not known to update each parameter on its own), "
                         "so no parameter can be updated alone in its backward hook. Use it without release, "
                         "or pass granularity='elementwise'/'tensor' if its update is (checked on the first steps)")
    out["granularity"] = granularity
    return out
