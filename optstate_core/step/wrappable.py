"""Optimizers that cannot be wrapped, each refused at ``wrap`` with the reason (nothing changes)."""
from __future__ import annotations

import logging

import torch

log = logging.getLogger("optstate")

#: package of an optimizer class -> why its state cannot be virtualized (it keeps it quantized or
#: paged in a form of its own, which decoding as plain tensors would silently change)
QUANTIZED_PACKAGES = {
    "bitsandbytes": "bitsandbytes optimizers keep their state in buffers of their own (8-bit blockwise "
                    "codes, paged memory) that their CUDA kernels read directly",
    "torchao": "torchao's low-bit optimizers keep their state as quantized tensor subclasses",
    "flashoptim": "flashoptim keeps companded 8-bit moments and its own master-weight correction",
}


def check_wrappable(optimizer) -> None:
    """Raise a ``ValueError`` naming why ``optimizer`` cannot be wrapped; return if it can."""
    name = type(optimizer).__name__
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"optimizer must be a torch.optim.Optimizer, got {name}")
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("optimizer: LBFGS re-evaluates the closure inside step() and keeps global "
                         "(not per-parameter) state; it cannot be wrapped")
    if isinstance(optimizer, torch.optim.SparseAdam):
        raise ValueError("optimizer: SparseAdam steps sparse gradients, and optstate keeps dense state only; "
                         "it cannot be wrapped (wrap Adam/AdamW for the dense parameters instead)")
    if isinstance(getattr(type(optimizer), "state", None), property):
        raise ValueError(f"optimizer: {name} keeps its state behind a read-only property 'state' (another "
                         "optimizer's, or one it computes), so optstate cannot put its store there; it cannot be wrapped")
    package = type(optimizer).__module__.split(".")[0]
    if package in QUANTIZED_PACKAGES:
        raise ValueError(f"optimizer: {package}.{name} cannot be wrapped: {QUANTIZED_PACKAGES[package]}. "
                         "Its state is compressed already; wrap the full-precision optimizer it replaces "
                         "(e.g. torch.optim.AdamW) with an optstate preset instead")
    for p, state in optimizer.state.items():
        for key, value in (state.items() if isinstance(state, dict) else ()):
            if isinstance(value, torch.Tensor) and type(value) not in (torch.Tensor, torch.nn.Parameter) and \
                    type(value).__name__ != "DTensor":
                raise ValueError(f"optimizer: {name}'s state {key!r} is a {type(value).__name__}, a tensor subclass "
                                 "(quantized or otherwise custom); optstate cannot decode it, so the optimizer "
                                 "cannot be wrapped")


def warn_about_checkpoint_overrides(optimizer) -> list:
    """Log a warning when the optimizer's class overrides ``state_dict``/``load_state_dict``: the
    wrapper saves and loads its state mapping and groups as torch does, so what the override adds
    (pytorch-optimizer's SPAM: its masks) or changes (dtypes it restores) is not carried. Returns
    the overridden names."""
    names = [n for n in ("state_dict", "load_state_dict")
             if getattr(type(optimizer), n) is not getattr(torch.optim.Optimizer, n)
             and not type(optimizer).__module__.startswith("torch.")]
    if names:
        log.warning("optstate: %s overrides %s; optstate's checkpoints hold its state and groups as torch's "
                    "do, not what the override adds or changes, so a resume may differ from its own "
                    "(docs/limitations.md)", type(optimizer).__name__, " and ".join(f"{n}()" for n in names))
    return names
