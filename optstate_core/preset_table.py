"""The named presets as data: one table of :class:`WarmupPolicy` arguments, and the one builder of
a preset's policy (``wrap(opt)`` and ``wrap(opt, "default")`` both use :func:`default_policy`)."""
from __future__ import annotations

from typing import Optional, Tuple

from .state.codecs import Int4Codec, Minifloat8Codec
from .policy import AdaptiveWarmupPolicy, WarmupPolicy

#: optimizer class -> state key -> codec, where an optimizer's state needs another codec than the
#: presets' moments (docs/compatibility.md, made by `optstate compat`): SGD's momentum buffer
#: (m <- mu*m + g) stalls at 4 bits with nearest rounding, so it rounds stochastically; Muon
#: orthogonalizes its momentum, which amplifies rounding noise, so it keeps int8 rounded to nearest
MUON_MOMENTUM = {"Muon": {"momentum_buffer": "int8"}}
OPTIMIZER_CODECS = {
    "8bit": MUON_MOMENTUM,
    "4bit": {"SGD": {"momentum_buffer": Int4Codec(stochastic_rounding=True)}, **MUON_MOMENTUM},
}

#: preset name -> WarmupPolicy arguments
PRESETS = {
    "fp32": dict(warmup_steps=0, momentum_codec="fp32", variance_codec="fp32"),
    "bf16": dict(warmup_steps=0, momentum_codec="bf16", variance_codec="bf16"),
    # stochastic rounding keeps the slow EMAs unbiased (a nearest-rounded int8 second moment can
    # stall: beta2 = 0.999 changes it by 0.1% a step, below its code step)
    "8bit": dict(warmup_steps=0, momentum_codec=Minifloat8Codec(stochastic_rounding=True),
                 variance_codec=Minifloat8Codec(stochastic_rounding=True), optimizer_codecs=OPTIMIZER_CODECS["8bit"]),
    # the 4-bit second moment rounds stochastically for the same reason
    "4bit": dict(warmup_steps=0, momentum_codec="int4", variance_codec=Int4Codec(stochastic_rounding=True),
                 optimizer_codecs=OPTIMIZER_CODECS["4bit"]),
    "offload": dict(warmup_steps=0, momentum_codec=Minifloat8Codec(stochastic_rounding=True),
                    variance_codec=Minifloat8Codec(stochastic_rounding=True), device_resident=False,
                    optimizer_codecs=OPTIMIZER_CODECS["8bit"]),
    # the smallest state: 4-bit for every tensor, biases and norms included (a 1-D one of a
    # length that is not a whole number of 256-blocks stays fp32: policy.splits_blocks)
    "4bit-all": dict(warmup_steps=0, momentum_codec="int4", variance_codec=Int4Codec(stochastic_rounding=True),
                     min_int8_elements=0, optimizer_codecs=OPTIMIZER_CODECS["4bit"]),
}
# bf16 parameters with fp32 master weights kept as optimizer state (see master_weights.py; cast the
# model with optstate_core.cast_model): "bf16w-*" keep the exact fp32 master (int16 correction),
# "-lean" a 16-bit-significand master (int8 correction). Bytes per parameter on the device with
# bf16 gradients: bf16w-8bit 2+2+2+2, bf16w-4bit 2+2+1+2, bf16w-8bit-lean 2+1+2+2, bf16w-4bit-lean
# 2+1+1+2 (weights + correction + moments + gradient; 2 fewer with gradient release).
# "-hostcorr": the lean correction in pinned host memory (weights and moments stay on the GPU): 2+2+2
# and 2+1+2 on the device, 0 for the correction; it crosses PCIe once each way per step (1 B/param).
# "-offload": moments and correction in pinned host memory, streamed through the staging ring every
# step (2.1 B/param each way for 4-bit); the device keeps the bf16 weights (2 B/param, plus the
# gradients: a batch of them with release_gradients=True). The smallest GPU footprint; for models
# that fit nothing else (docs/offload.md). "bf16w-4bit-lean" with gpu_budget=... keeps state resident up to
# the budget and streams the rest the same way.
for _moments in ("8bit", "4bit"):
    PRESETS[f"bf16w-{_moments}"] = dict(PRESETS[_moments], master_correction="corr16")
    PRESETS[f"bf16w-{_moments}-lean"] = dict(PRESETS[_moments], master_correction="corr8")
    PRESETS[f"bf16w-{_moments}-lean-hostcorr"] = dict(PRESETS[_moments], master_correction="corr8",
                                                      master_tier="host")
    PRESETS[f"bf16w-{_moments}-lean-offload"] = dict(PRESETS[_moments], master_correction="corr8",
                                                     device_resident=False)
# schedule-free's iterate z (any state in policy.ITERATE_KEYS) as bf16 + an 8-bit residual (fp24: 3 bytes,
# within 2**-15 relative): schedule-free AdamW keeps 3 + 1 B/param with "8bit-it24" instead of 4 + 1
for _moments in ("8bit", "4bit"):
    PRESETS[f"{_moments}-it24"] = dict(PRESETS[_moments], iterate_codec="fp24")
PRESETS["default"] = PRESETS["8bit"]
PRESET_ALIASES = {"int8": "8bit", "int4": "4bit", "none": "fp32"}


#: the preset chosen per model and device by ``optstate plan``'s arithmetic, which the core cannot import
AUTO = "auto"
#: any preset name + this suffix ("bf16w-4bit-lean-stream"): that preset's policy, wrapped with the option
#: ``stream_weights=True`` (the weights streamed from host memory; docs/weight-streaming.md)
STREAM_SUFFIX = "-stream"


def split_stream(preset):
    """``(the name without a -stream suffix, whether it had one)``: ``"8bit-stream"`` -> ``("8bit", True)``."""
    if isinstance(preset, str) and preset.endswith(STREAM_SUFFIX) and len(preset) > len(STREAM_SUFFIX):
        return preset[:-len(STREAM_SUFFIX)], True
    return preset, False


def _table_name(preset: str, typed: Optional[str] = None) -> str:
    """The table's key for ``preset`` (aliases resolved); ValueError, naming what was ``typed``, for the rest."""
    if preset == AUTO:
        raise ValueError("preset 'auto' is planned per model and device: optstate_core.apps.auto.wrap(optimizer, "
                         "model) (the planner is an app, which the core does not import; docs/presets.md#auto)")
    name = PRESET_ALIASES.get(preset, preset)
    if name not in PRESETS:
        raise ValueError(f"unknown preset {typed or preset!r}; valid presets: {', '.join(sorted(PRESETS))} "
                         f"(each also with the suffix {STREAM_SUFFIX!r})")
    return name


def with_stream(preset: str, options: dict) -> Tuple[str, dict]:
    """``(the base preset, options)`` for a preset name: a ``-stream`` one adds ``stream_weights=True``."""
    base, stream = split_stream(preset)
    if not stream:
        return preset, options
    if base != AUTO:
        _table_name(base, typed=preset)
    if options.get("stream_weights") is False:
        raise ValueError(f"stream_weights=False contradicts preset {preset!r} (its {STREAM_SUFFIX!r} streams the "
                         f"weights): name the preset {base!r}, or leave stream_weights out")
    return base, {"stream_weights": True, **options}  # a bad value given is the options' to refuse


def make_policy(preset: str = "default", *, adaptive: bool = False, **overrides) -> WarmupPolicy:
    """A :class:`WarmupPolicy` from a preset name, with any of its arguments overridden; with
    ``adaptive=True`` an :class:`AdaptiveWarmupPolicy` (``patience`` and ``tol`` among the overrides).
    A ``-stream`` name raises: streaming is a wrap option (``wrap(optimizer, name)`` takes it)."""
    base, stream = split_stream(preset)
    if stream:
        _table_name(base, typed=preset)
        raise ValueError(f"preset {preset!r}: {STREAM_SUFFIX!r} streams the weights, which is a wrap option and "
                         f"not part of a policy: wrap(optimizer, {preset!r}) or OptStateAdamW(preset={preset!r}), "
                         f"or make_policy({base!r}) wrapped with stream_weights=True")
    name = _table_name(preset)
    return (AdaptiveWarmupPolicy if adaptive else WarmupPolicy)(**{**PRESETS[name], **overrides})


def has_master_weights(preset: Optional[str]) -> bool:
    """Whether a preset keeps fp32 master weights for bf16 parameters (the ``bf16w-*`` presets, also
    with ``-stream``: cast the model with :func:`optstate_core.cast_model` first)."""
    if preset is None:
        return False
    base = split_stream(preset)[0]
    return PRESETS[PRESET_ALIASES.get(base, base)].get("master_correction") is not None


def default_policy() -> WarmupPolicy:
    """The policy of ``wrap(optimizer)``, ``wrap(optimizer, "default")`` and ``VirtualOptimizer(optimizer)``:
    the ``"default"`` preset (= ``"8bit"``)."""
    return make_policy("default")
