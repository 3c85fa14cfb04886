"""``wrap``, ``unwrap`` and :class:`OptStateAdamW` over the preset table (:mod:`.preset_table`; it
and torch-optstate's constructors, :mod:`.torch_optstate_names`, are re-exported here); the
integrations expose the table's names
(``optstate_adamw`` = ``default``, ``optstate_adamw_8bit`` = ``8bit``, ...).
"""
from __future__ import annotations

from typing import Optional, Union

import torch

from .optimizer import VirtualOptimizer
from .options import WrapOptions
from .policy import Policy
from .preset_table import (AUTO, OPTIMIZER_CODECS, PRESET_ALIASES, PRESETS, STREAM_SUFFIX,  # noqa: F401 (re-exported)
                           default_policy, has_master_weights, make_policy, split_stream, with_stream)
from .torch_optstate_names import (auto_wrap, make_low_memory_policy, wrap_low_memory_adamw,  # noqa: F401 (re-exported)
                                   wrap_max_compression_adamw)


def wrap(optimizer: torch.optim.Optimizer, policy: Union[Policy, str, None] = None,
         options: Optional[WrapOptions] = None, **option_values) -> VirtualOptimizer:
    """Wrap any torch optimizer. ``policy``: a Policy, a preset name, or None (the default preset);
    a preset name ending in ``-stream`` (``"bf16w-4bit-lean-stream"``) is that preset with
    ``stream_weights=True``. The options are :class:`VirtualOptimizer`'s, as keywords (chunk_bytes,
    gpu_budget, release_gradients, stream_weights, ...) and/or one :class:`WrapOptions`."""
    if isinstance(policy, str):
        preset, option_values = with_stream(policy, option_values)
        policy = make_policy(preset)
    return VirtualOptimizer(optimizer, policy, options, **option_values)


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


def stream_weights(model, optimizer, *, layers=None, prefetch: int = 1, offload_activations=None):
    """Keep the weights of ``model``'s decoder layers in host memory and stream them through the
    device around each visit; ``optimizer``: its wrapped optimizer (or a framework's wrapper of it),
    built with ``release_gradients=True``. See :meth:`VirtualOptimizer.stream_weights`."""
    found = unwrap(optimizer)
    if found is None:
        raise ValueError(f"stream_weights: optimizer must be a wrapped optimizer (optstate_core.wrap), "
                         f"got {type(optimizer).__name__}")
    return found.stream_weights(model, layers=layers, prefetch=prefetch, offload_activations=offload_activations)


class OptStateAdamW(VirtualOptimizer):
    """``torch.optim.AdamW`` built from ``params`` and wrapped with a preset, in one class.

    For frameworks that instantiate an optimizer class as ``cls(params, **kwargs)`` (the HF
    Trainer, Lightning CLI). ``preset`` is a name from :data:`PRESETS` (or one + ``-stream``: the
    option ``stream_weights=True``), ``policy_options`` override the preset's :class:`WarmupPolicy`
    arguments, ``wrap_options`` go to :class:`VirtualOptimizer`.
    """

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2,
                 amsgrad: bool = False, *, preset: str = "default", policy: Optional[Policy] = None,
                 policy_options: Optional[dict] = None, wrap_options: Optional[dict] = None, **adamw_kwargs):
        inner = torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                                  **adamw_kwargs)
        preset, wrap_options = with_stream(preset, dict(wrap_options or {}))
        if policy is None:
            policy = make_policy(preset, **(policy_options or {}))
        elif policy_options:
            raise ValueError("policy_options can only be given with a preset, not with policy")
        super().__init__(inner, policy, **wrap_options)
