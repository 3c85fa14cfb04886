"""torch-optstate's names, in one module: ``auto_wrap``, ``wrap_low_memory_adamw``,
``wrap_max_compression_adamw``, ``make_low_memory_policy`` (and ``OptimizerWrapper``, the
:class:`VirtualOptimizer` alias in ``optstate_core``), with their ``chunk_size_on_cuda``."""
from __future__ import annotations

from typing import Iterable, Optional

import torch

from .state.codecs import Codec, Minifloat8Codec
from .optimizer import VirtualOptimizer
from .options import check_optional_int
from .policy import Policy, WarmupPolicy
from .preset_table import default_policy


def _chunk_size(optimizer: torch.optim.Optimizer, chunk_size: Optional[int], chunk_size_on_cuda: Optional[int]):
    """torch-optstate's rule: ``chunk_size_on_cuda`` is the chunk size when the parameters are on CUDA."""
    on_cuda = check_optional_int("chunk_size_on_cuda", chunk_size_on_cuda)
    if chunk_size is None and on_cuda is not None and any(p.is_cuda for g in optimizer.param_groups for p in g["params"]):
        return on_cuda
    return chunk_size


def auto_wrap(optimizer: torch.optim.Optimizer, policy: Optional[Policy] = None, chunk_size: Optional[int] = None,
              chunk_size_on_cuda: Optional[int] = None, initial_chunk_size: Optional[int] = None,
              pin_memory: Optional[bool] = None, profile: bool = False, **options) -> VirtualOptimizer:
    """One call with sensible defaults: int8 momentum and second moment, on the parameters'
    device, small tensors uncompressed, chunks bounded in bytes."""
    return VirtualOptimizer(optimizer, policy or default_policy(), profile=profile,
                            chunk_size=_chunk_size(optimizer, chunk_size, chunk_size_on_cuda),
                            initial_chunk_size=initial_chunk_size, pin_memory=pin_memory, **options)


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
    inner = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, **adamw_kwargs)
    return VirtualOptimizer(inner, policy, chunk_size=_chunk_size(inner, chunk_size, chunk_size_on_cuda),
                            initial_chunk_size=initial_chunk_size, pin_memory=pin_memory)


def wrap_max_compression_adamw(params: Iterable, lr: float = 1e-3, weight_decay: float = 0.01,
                               chunk_size: Optional[int] = None, chunk_size_on_cuda: Optional[int] = 256,
                               initial_chunk_size: Optional[int] = 1, pin_memory: Optional[bool] = None,
                               device_resident: Optional[bool] = None, **adamw_kwargs) -> VirtualOptimizer:
    """AdamW with int8 momentum and second moment for every tensor (biases and norms too), from
    the first step: torch-optstate 0.1.1's "int8-all state". For 4-bit everywhere use the
    ``"4bit-all"`` preset."""
    policy = WarmupPolicy(warmup_steps=0, momentum_codec=Minifloat8Codec(stochastic_rounding=True),
                          variance_codec=Minifloat8Codec(stochastic_rounding=True), min_int8_elements=0,
                          whole_blocks_1d=False, device_resident=device_resident)
    inner = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, **adamw_kwargs)
    return VirtualOptimizer(inner, policy, chunk_size=_chunk_size(inner, chunk_size, chunk_size_on_cuda),
                            initial_chunk_size=initial_chunk_size, pin_memory=pin_memory)
