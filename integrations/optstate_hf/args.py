"""``optim_args`` for the optstate optimizers: typed parsing, then policy and wrap options.

``TrainingArguments(optim_args="state=int8,offload=none,warmup_steps=100")`` reaches the
optimizer as strings; :func:`parse_optim_args` turns them into an :class:`OptimArgs` (typed,
validated, immutable), which builds the :class:`optstate_core.WarmupPolicy` (or
``AdaptiveWarmupPolicy``) on top of a preset from ``optstate_core.PRESETS`` and the
``VirtualOptimizer`` options.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable, Dict, Mapping, Optional, Union

import optstate_core as oc
from optstate_core.presets import split_stream

OFFLOAD = ("none", "host")
_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")


def _codec(text) -> str:
    name = str(text).strip().lower()
    if name not in oc.MOMENT_CODECS:
        raise ValueError(f"must be one of {', '.join(oc.MOMENT_CODECS)}")
    return name


def _offload(text) -> str:
    name = str(text).strip().lower()
    if name not in OFFLOAD:
        raise ValueError(f"must be one of {', '.join(OFFLOAD)}")
    return name


def _bool(text: str) -> bool:
    if isinstance(text, bool):
        return text
    low = str(text).strip().lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise ValueError("must be true or false")


def _int(minimum: Optional[int]) -> Callable[[str], int]:
    def parse(text) -> int:
        if isinstance(text, bool):
            raise ValueError("must be an integer")
        try:
            value = text if isinstance(text, int) else int(str(text).strip())
        except ValueError:
            raise ValueError("must be an integer") from None
        if minimum is not None and value < minimum:
            raise ValueError(f"must be >= {minimum}")
        return value
    return parse


def _tol(text) -> float:
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise ValueError("must be a number") from None
    if not 0 <= value < 1:
        raise ValueError("must be in [0, 1)")
    return value


def _loss(text) -> str:
    from optstate_core.apps.auto import LOSSES
    name = str(text).strip().lower()
    if name not in LOSSES:
        raise ValueError(f"must be one of {', '.join(LOSSES)}")
    return name


def _clip_mode(text) -> str:
    from optstate_core.schedule.release import CLIP_MODES
    s = str(text).strip().lower()
    if s not in CLIP_MODES:
        raise ValueError(f"must be one of {', '.join(CLIP_MODES)}")
    return s


def _size_or_zero(text) -> Union[int, str]:
    """A byte count as :func:`_size`, or 0."""
    return 0 if str(text).strip() == "0" else _size(text)


def _size(text) -> Union[int, str]:
    """A byte count checked by the core's parser (``optstate_core.parse_bytes``): an int, or a string
    such as ``64MB`` / ``2GiB`` (kept as text; the core parses it again where it is used)."""
    try:
        oc.parse_bytes(text, "size")
    except ValueError as e:
        raise ValueError("must be positive" if "must be positive" in str(e) else
                         "must be a positive byte count such as 67108864, 64MB or 2GiB") from None
    s = str(text).strip()
    return int(s) if s.isdigit() else text


@dataclass(frozen=True)
class Key:
    parse: Callable
    help: str
    target: str  # "policy", "wrap", "adaptive" or "auto" (optstate_adamw_auto's plan)


#: Every accepted ``optim_args`` key: parser, meaning, and where it goes.
KEYS: Dict[str, Key] = {
    "state": Key(_codec, f"codec of both moments ({'/'.join(oc.MOMENT_CODECS)})", "policy"),
    "momentum": Key(_codec, "codec of the first moment (overrides state)", "policy"),
    "variance": Key(_codec, "codec of the second moment (overrides state)", "policy"),
    "offload": Key(_offload, "where compressed state lives between steps: none (the parameters' device) "
                             "or host (CPU memory)", "policy"),
    "warmup_steps": Key(_int(0), "steps kept uncompressed (fp32) before the codecs switch on", "policy"),
    "min_int8_elements": Key(_int(0), "tensors with fewer elements stay fp32", "policy"),
    "stochastic_rounding": Key(_bool, "stochastic rounding when encoding (counter-based, reproducible)", "policy"),
    "adaptive": Key(_bool, "end the warmup early when the logged loss plateaus (needs warmup_steps > 0)",
                    "adaptive"),
    "patience": Key(_int(1), "adaptive: stale loss logs before switching (default 5)", "adaptive"),
    "tol": Key(_tol, "adaptive: relative improvement that counts as progress (default 1e-3)", "adaptive"),
    "chunk_bytes": Key(_size, "bound on full-precision state materialized at once during a step (default 64MB)",
                       "wrap"),
    "chunk_size": Key(_int(1), "at most this many tiles per chunk", "wrap"),
    "seed": Key(_int(None), "seed of the stochastic-rounding hash", "wrap"),
    "gpu_budget": Key(_size, "device bytes of optimizer state kept resident; the rest streams from host memory "
                            "(pass-through to the core; works with release_gradients)", "wrap"),
    "prefetch_during_backward": Key(_bool, "fetch offloaded state during the backward that ends in a step "
                                           "(pass-through to the core)", "wrap"),
    "release_gradients": Key(_bool, "update each parameter in backward and free its gradient; the Trainer's "
                                    "max_grad_norm is routed to the optimizer", "wrap"),
    "clip_mode": Key(_clip_mode, "how max_grad_norm clips: auto, global, previous or per_tensor", "wrap"),
    "release_bucket_bytes": Key(_size_or_zero, "with release_gradients: gradient bytes pending before one batched "
                                               "update (default 256MiB; 0: each parameter in its own hook)", "wrap"),
    "stream_weights": Key(_bool, "keep the decoder layers' weights in host memory and stream them through the GPU "
                                 "from the start of training (turns release_gradients on, as a _stream optim name "
                                 "does; docs/weight-streaming.md)", "wrap"),
    "offload_activations": Key(_bool, "with stream_weights: the layer inputs activation checkpointing keeps go to "
                                      "host memory between forward and recompute (docs/weight-streaming.md)", "wrap"),
    "seq_len": Key(_int(1), "auto: tokens per sequence to plan for (default: the trainer's max_length, else the "
                            "model's max_position_embeddings)", "auto"),
    "gpu_memory": Key(_size, "auto: GPU bytes to plan for (default: the device's free memory plus this process's "
                             "reserve; none on the CPU)", "auto"),
    "activations": Key(_size_or_zero, "auto: activation bytes at the step's peak (default: the planner's estimate, "
                                      "Llama-family models only)", "auto"),
    "loss": Key(_loss, "auto: plain (logits materialized) or fused/chunked/liger (none); default: use_liger_kernel "
                       "or a model with the chunked loss, else plain", "auto"),
}
#: wrap options that are forwarded only when the installed optstate_core accepts them.
PASS_THROUGH = ("gpu_budget", "prefetch_during_backward")


def valid_keys_text() -> str:
    return ", ".join(KEYS)


def _error(message: str) -> ValueError:
    return ValueError(f"optim_args: {message}. Valid keys: {valid_keys_text()}")


def split_optim_args(text: str) -> Dict[str, str]:
    """``"k=v,k2=v2"`` -> ``{"k": "v", "k2": "v2"}`` (spaces ignored, as the Trainer does)."""
    items: Dict[str, str] = {}
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        key, sep, value = part.partition("=")
        if not sep or not key:
            raise _error(f"expected key=value, got {part!r}")
        if key in items:
            raise _error(f"key {key!r} given twice")
        items[key] = value
    return items


class OptimArgs:
    """Parsed, typed ``optim_args`` (only the keys that were given). Build with
    :func:`parse_optim_args`; read with ``args.get(key)`` / ``key in args``."""

    def __init__(self, values: Optional[Mapping[str, object]] = None):
        self._values = dict(values or {})

    def get(self, key: str, default=None):
        return self._values.get(key, default)

    def __contains__(self, key: str) -> bool:
        return key in self._values

    def __eq__(self, other) -> bool:
        return isinstance(other, OptimArgs) and self._values == other._values

    def __repr__(self) -> str:
        return f"OptimArgs({self._values!r})"

    def as_dict(self) -> dict:
        return dict(self._values)

    # -- what the optimizer is built from ----------------------------------------------------
    def policy(self, preset: str = "default") -> oc.WarmupPolicy:
        """The preset's policy with these overrides (``oc.make_policy``; AdaptiveWarmupPolicy if ``adaptive``);
        a ``-stream`` suffix is the wrap option's (:meth:`wrap_options` and ``with_stream``), not the policy's."""
        preset = split_stream(preset)[0]
        if preset not in oc.PRESETS:
            raise ValueError(f"preset must be one of {', '.join(sorted(oc.PRESETS))}, got {preset!r}")
        planned = [k for k in self._values if KEYS[k].target == "auto"]
        if planned:
            raise _error(f"{', '.join(planned)} only apply with optim='optstate_adamw_auto' (preset {preset!r})")
        overrides = {}
        if "state" in self:
            overrides["momentum_codec"] = overrides["variance_codec"] = self.get("state")
        if "momentum" in self:
            overrides["momentum_codec"] = self.get("momentum")
        if "variance" in self:
            overrides["variance_codec"] = self.get("variance")
        if "offload" in self:
            overrides["device_resident"] = False if self.get("offload") == "host" else None
        for key in ("warmup_steps", "min_int8_elements"):
            if key in self:
                overrides[key] = self.get(key)
        if self.get("stochastic_rounding"):
            for role in ("momentum_codec", "variance_codec"):
                spec = overrides.get(role, oc.PRESETS[preset].get(role))
                if isinstance(spec, str) and spec != "fp32":
                    overrides[role] = oc.get_codec(spec, stochastic_rounding=True)
        if self.get("adaptive"):
            overrides.update(patience=self.get("patience", 5), tol=self.get("tol", 1e-3))
        return oc.make_policy(preset, adaptive=bool(self.get("adaptive")), **overrides)

    def wrap_options(self) -> dict:
        """Options for ``optstate_core.VirtualOptimizer``."""
        out = {k: v for k, v in self._values.items() if KEYS[k].target == "wrap"}
        if "prefetch_during_backward" in out:  # the core's current spelling (the old one warns there)
            out["prefetch_budget"] = "auto" if out.pop("prefetch_during_backward") else 0
        return out


def _core_accepts(option: str) -> bool:
    params = inspect.signature(oc.VirtualOptimizer.__init__).parameters
    return option in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def parse_optim_args(optim_args: Union[None, str, Mapping, OptimArgs]) -> OptimArgs:
    """Parse and validate ``optim_args`` (a ``"k=v,..."`` string, a mapping, or parsed already).

    Raises ValueError naming the key and listing the valid keys for an unknown key, a bad
    value, or an inconsistent combination (e.g. ``patience`` without ``adaptive=true``).
    """
    if optim_args is None:
        return OptimArgs()
    if isinstance(optim_args, OptimArgs):
        return optim_args
    if isinstance(optim_args, str):
        optim_args = split_optim_args(optim_args)
    if not isinstance(optim_args, Mapping):
        raise ValueError(f"optim_args must be a 'key=value,...' string or a mapping, got {type(optim_args).__name__}")
    parsed = {}
    for key, raw in optim_args.items():
        spec = KEYS.get(key)
        if spec is None:
            raise _error(f"unknown key {key!r}")
        try:
            parsed[key] = spec.parse(raw)
        except ValueError as e:
            raise _error(f"{key}={raw!r} {e}") from None
    if not parsed.get("adaptive"):
        extra = [k for k in ("patience", "tol") if k in parsed]
        if extra:
            raise _error(f"{', '.join(extra)} only apply with adaptive=true")
    elif parsed.get("warmup_steps", 0) <= 0:
        raise _error("adaptive=true needs warmup_steps > 0 (the latest step at which compression starts)")
    for key in PASS_THROUGH:
        if key in parsed and not _core_accepts(key):
            raise _error(f"{key} is not supported by the installed optstate_core "
                         f"(VirtualOptimizer takes no {key!r} option); remove it or upgrade optstate")
    return OptimArgs(parsed)
