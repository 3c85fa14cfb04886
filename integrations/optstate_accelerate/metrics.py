"""Metrics to ``accelerator.log`` and a rank-consistent loss for the policy."""
from __future__ import annotations

from typing import Dict, Optional

import torch

from .prepared import check_accelerator, unwrap_optimizer


def log_metrics(accelerator, optimizer, step: Optional[int] = None, prefix: str = "optstate/") -> Dict[str, float]:
    """Log ``optimizer.log_metrics(prefix)`` through ``accelerator.log`` (main process only, as
    ``accelerator.log`` does) and return the dict. ``step`` defaults to the optimizer's step count."""
    check_accelerator(accelerator)
    vopt = unwrap_optimizer(optimizer)
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
        raise ValueError(f"step must be None or an int >= 0, got {step!r}")
    if not isinstance(prefix, str):
        raise ValueError(f"prefix must be a string, got {type(prefix).__name__}")
    values = vopt.log_metrics(prefix)
    accelerator.log(values, step=vopt.step_count if step is None else step)
    return values


def observe_loss(accelerator, optimizer, loss) -> float:
    """Average ``loss`` over all processes and feed it to the optimizer's policy.

    A collective: call it on every process at the same point, e.g. once per optimizer step
    (``if accelerator.sync_gradients: ...``), so an :class:`optstate_core.AdaptiveWarmupPolicy`
    switches on the same step on every rank. Returns the averaged loss.
    """
    check_accelerator(accelerator)
    vopt = unwrap_optimizer(optimizer)
    if isinstance(loss, torch.Tensor):
        if loss.numel() != 1:
            raise ValueError(f"loss must be a scalar, got a tensor of shape {tuple(loss.shape)}")
        value = loss.detach().reshape(()).float().to(accelerator.device)
    elif isinstance(loss, (int, float)) and not isinstance(loss, bool):
        value = torch.tensor(float(loss), device=accelerator.device)
    else:
        raise ValueError(f"loss must be a number or a scalar tensor, got {type(loss).__name__}")
    mean = float(accelerator.reduce(value, reduction="mean"))
    vopt.observe_loss(mean)
    return mean
