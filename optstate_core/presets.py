"""The helper constructors (``wrap``, ``auto_wrap``, ``wrap_*_adamw``, :class:`OptStateAdamW`) over
the preset table (:mod:`.preset_table`, re-exported here); the integrations expose its names
(``optstate_adamw`` = ``default``, ``optstate_adamw_8bit`` = ``8bit``, ...).
"""
from __future__ import annotations

from typing import Iterable, Optional, Union

import torch

from .state.codecs import Codec, Int8Codec
from .optimizer import VirtualOptimizer
from .policy import Policy, WarmupPolicy
from .preset_table import (OPTIMIZER_CODECS, PRESET_ALIASES, PRESETS, default_policy,  # noqa: F401 (re-exported)
                           has_master_weights, make_policy)


def wrap(optimizer: torch.optim.Optimizer, policy: Union[Policy, str, None] = None, **options) -> VirtualOptimizer:
    """Wrap any torch optimizer. ``policy``: a Policy, a preset name, or None (the default preset).
    ``options`` are :class:`VirtualOptimizer`'s (chunk_bytes, chunk_size, pin_memory, ...)."""
    if isinstance(policy, str):
        policy = make_policy(policy)
    return VirtualOptimizer(optimizer, policy, **options)


def unwrap(optimizer, depth: int = 8) -> Optional[VirtualOptimizer]:
    """The :class:`VirtualOptimizer` inside a framework's optimizer (``optimizer`` itself, or the
    one a wrapper keeps as ``.optimizer``: Accelerate's ``AcceleratedOptimizer``, Lightning's,
    DeepSpeed's, up to ``depth`` wrappers deep), or None."""
    for _ in range(depth):
        if isinstance(optimizer, VirtualOptimizer):
            return optimizer
        optimizer = getattr(optimizer, "optimizer", None)
    return None


def auto_wrap(optimizer: torch.optim.Optimizer, policy: Optional[Policy] = None, chunk_size: Optional[int] = None,
              chunk_size_on_cuda: Optional[int] = None, initial_chunk_size: Optional[int] = None,
              pin_memory: Optional[bool] = None, profile: bool = False, **options) -> VirtualOptimizer:
    """One call with sensible defaults: int8 momentum and second moment, on the parameters'
    device, small tensors uncompressed, chunks bounded in bytes."""
    return VirtualOptimizer(optimizer, policy or default_policy(), chunk_size=chunk_size,
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
                          whole_blocks_1d=False, device_resident=device_resident)
    return VirtualOptimizer(torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, **adamw_kwargs), policy,
                            chunk_size=chunk_size, chunk_size_on_cuda=chunk_size_on_cuda,
                            initial_chunk_size=initial_chunk_size, pin_memory=pin_memory)
