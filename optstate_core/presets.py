"""Named presets and the helper constructors (``wrap``, ``auto_wrap``, ``wrap_*_adamw``).

``PRESETS`` is the one table of preset names; the integrations expose these names
(``optstate_adamw`` = ``default``, ``optstate_adamw_8bit`` = ``8bit``, ...).
"""
from __future__ import annotations

from typing import Iterable, Optional, Union

import torch

from .state.codecs import Codec, Int4Codec, Int8Codec
from .optimizer import VirtualOptimizer
from .policy import Policy, WarmupPolicy

#: optimizer class -> state key -> codec, where an optimizer's state needs another codec than the
#: presets' moments (docs/compatibility.md, made by `optstate compat`): SGD's momentum buffer
#: (m <- mu*m + g) stalls at 4 bits with nearest rounding (the task's final loss +12%, stochastic
#: rounding: within the seed spread); Muon orthogonalizes its momentum, which amplifies rounding
#: noise: int8 with nearest rounding holds its loss, stochastic or 4-bit codes do not
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
    # stall: beta2 = 0.999 changes it by 0.1% a step, below its code step); see docs/benchmarks-journal.md
    "8bit": dict(warmup_steps=0, momentum_codec=Int8Codec(stochastic_rounding=True),
                 variance_codec=Int8Codec(stochastic_rounding=True), optimizer_codecs=OPTIMIZER_CODECS["8bit"]),
    # the 4-bit second moment rounds stochastically for the same reason: fine-tuning from a
    # checkpoint (bench --convergence --finetune, docs/benchmarks-journal.md section 12) ended +0.53% above
    # AdamW with nearest rounding, +0.03% with it (AdamW's seed spread there: 0.32%)
    "4bit": dict(warmup_steps=0, momentum_codec="int4", variance_codec=Int4Codec(stochastic_rounding=True),
                 optimizer_codecs=OPTIMIZER_CODECS["4bit"]),
    "offload": dict(warmup_steps=0, momentum_codec=Int8Codec(stochastic_rounding=True),
                    variance_codec=Int8Codec(stochastic_rounding=True), device_resident=False,
                    optimizer_codecs=OPTIMIZER_CODECS["8bit"]),
    # the smallest state: 4-bit for every tensor, biases and norms included (tests/test_fidelity.py's
    # 300-step task: +1.41% of AdamW's tail loss, where "4bit", small tensors fp32, is +0.31%)
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


def make_policy(preset: str = "default", **overrides) -> WarmupPolicy:
    """A :class:`WarmupPolicy` from a preset name, with any of its arguments overridden."""
    name = PRESET_ALIASES.get(preset, preset)
    if name not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; valid presets: {', '.join(sorted(PRESETS))}")
    return WarmupPolicy(**{**PRESETS[name], **overrides})


def has_master_weights(preset: Optional[str]) -> bool:
    """Whether a preset keeps fp32 master weights for bf16 parameters (the ``bf16w-*`` presets:
    cast the model with :func:`optstate_core.cast_model` first)."""
    if preset is None:
        return False
    return PRESETS[PRESET_ALIASES.get(preset, preset)].get("master_correction") is not None


def wrap(optimizer: torch.optim.Optimizer, policy: Union[Policy, str, None] = None, **options) -> VirtualOptimizer:
    """Wrap any torch optimizer. ``policy``: a Policy, a preset name, or None (the default preset).
    ``options`` are :class:`VirtualOptimizer`'s (chunk_bytes, chunk_size, pin_memory, ...)."""
    if isinstance(policy, str):
        policy = make_policy(policy)
    return VirtualOptimizer(optimizer, policy, **options)


def unwrap(optimizer, depth: int = 8) -> Optional[VirtualOptimizer]:
    """The :class:`VirtualOptimizer` inside a framework's optimizer (``optimizer`` itself, or the
    one a wrapper keeps as ``.optimizer``: Accelerate's ``AcceleratedOptimizer``, Lightning's,
    DeepSpeed's, up to ``depth`` wrappers deep), or None. A wrapper that imitates its optimizer's
    class (Lightning Fabric's ``_FabricOptimizer``, Lightning's ``LightningOptimizer``) is an
    instance of it too: the one it keeps as ``.optimizer`` is returned, not the shell."""
    for _ in range(depth):
        inner = getattr(optimizer, "optimizer", None)
        if isinstance(optimizer, VirtualOptimizer) and not isinstance(inner, VirtualOptimizer):
            return optimizer
        optimizer = inner
    return None


def auto_wrap(optimizer: torch.optim.Optimizer, policy: Optional[Policy] = None, chunk_size: Optional[int] = None,
              chunk_size_on_cuda: Optional[int] = None, initial_chunk_size: Optional[int] = None,
              pin_memory: Optional[bool] = None, profile: bool = False, **options) -> VirtualOptimizer:
    """One call with sensible defaults: int8 momentum and second moment, on the parameters'
    device, small tensors uncompressed, chunks bounded in bytes."""
    return VirtualOptimizer(optimizer, policy or make_policy("default"), chunk_size=chunk_size,
                            chunk_size_on_cuda=chunk_size_on_cuda, initial_chunk_size=initial_chunk_size,
                            pin_memory=pin_memory, profile=profile, **options)


class OptStateAdamW(VirtualOptimizer):
    """``torch.optim.AdamW`` built from ``params`` and wrapped with a preset, in one class.

    For frameworks that instantiate an optimizer class as ``cls(params, **kwargs)`` (the HF
    Trainer, Lightning CLI). ``preset`` is a name from :data:`PRESETS`, ``policy_options``
    override the preset's :class:`WarmupPolicy` arguments, ``wrap_options`` go to
    :class:`VirtualOptimizer`.
    """

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2,
                 amsgrad: bool = False, *, preset: str = "default", policy: Optional[Policy] = None,
                 policy_options: Optional[dict] = None, wrap_options: Optional[dict] = None, **adamw_kwargs):
        inner = torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                                  **adamw_kwargs)
        if policy is None:
            policy = make_policy(preset, **(policy_options or {}))
        elif policy_options:
            raise ValueError("policy_options can only be given with a preset, not with policy")
        super().__init__(inner, policy, **(wrap_options or {}))


VARIANCE_MODES = ("fp16", "int8", "int8_variance", "int8_all", "int4", "bf16", "fp32")


def make_low_memory_policy(warmup_steps: int = 10, variance_mode: str = "fp16", momentum_key: str = "exp_avg",
                           variance_key: str = "exp_avg_sq", min_int8_elements: int = 4096,
                           small_tensor_codec: Optional[Codec] = None,
                           device_resident: Optional[bool] = None) -> WarmupPolicy:
    """int8 momentum; the second moment as ``variance_mode`` says (torch-optstate's helper)."""
    if variance_mode not in VARIANCE_MODES:
        raise ValueError(f"variance_mode must be one of {', '.join(VARIANCE_MODES)}; got {variance_mode!r}")
    variance = "int8" if variance_mode.startswith("int8") else variance_mode
    return WarmupPolicy(warmup_steps=warmup_steps, momentum_key=momentum_key, variance_key=variance_key,
                        variance_codec=variance, min_int8_elements=min_int8_elements,
                        small_tensor_codec=small_tensor_codec, device_resident=device_resident)


def wrap_low_memory_adamw(params: Iterable, lr: float = 1e-3, weight_decay: float = 0.01, warmup_steps: int = 10,
                          variance_mode: str = "fp16", chunk_size: Optional[int] = 32,
                          initial_chunk_size: Optional[int] = 1, pin_memory: Optional[bool] = None,
                          min_int8_elements: int = 4096, small_tensor_codec: Optional[Codec] = None,
                          device_resident: Optional[bool] = None, chunk_size_on_cuda: Optional[int] = None,
                          **adamw_kwargs) -> VirtualOptimizer:
    """AdamW with int8 momentum and a block-scaled fp16 (never underflowing) second moment."""
    policy = make_low_memory_policy(warmup_steps, variance_mode, min_int8_elements=min_int8_elements,
                                    small_tensor_codec=small_tensor_codec, device_resident=device_resident)
    return VirtualOptimizer(torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, **adamw_kwargs), policy,
                            chunk_size=chunk_size, initial_chunk_size=initial_chunk_size, pin_memory=pin_memory,
                            chunk_size_on_cuda=chunk_size_on_cuda)


def wrap_max_compression_adamw(params: Iterable, lr: float = 1e-3, weight_decay: float = 0.01,
                               chunk_size: Optional[int] = None, chunk_size_on_cuda: Optional[int] = 256,
                               initial_chunk_size: Optional[int] = 1, pin_memory: Optional[bool] = None,
                               device_resident: Optional[bool] = None, **adamw_kwargs) -> VirtualOptimizer:
    """AdamW with int8 momentum and second moment for every tensor (biases and norms too), from
    the first step: torch-optstate 0.1.1's "int8-all state". For 4-bit everywhere use the
    ``"4bit-all"`` preset."""
    policy = WarmupPolicy(warmup_steps=0, momentum_codec=Int8Codec(stochastic_rounding=True),
                          variance_codec=Int8Codec(stochastic_rounding=True), min_int8_elements=0,
                          device_resident=device_resident)
    return VirtualOptimizer(torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, **adamw_kwargs), policy,
                            chunk_size=chunk_size, chunk_size_on_cuda=chunk_size_on_cuda,
                            initial_chunk_size=initial_chunk_size, pin_memory=pin_memory)
