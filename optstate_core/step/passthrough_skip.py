"""NaN/inf skipping for uncompressed (passthrough) parameters stepped by torch's fused Adam/AdamW,
on the device: torch's own ``found_inf`` input skips the whole call, with no host synchronisation.

The unit is the passthrough call of a step (every parameter whose state stays fp32 and that
torch's fused kernel updates): if any of their gradients holds a NaN/inf, none of them moves,
their states keep their values and their ``step`` counts stay put (torch restores them), and
the event counts once per parameter. With finite gradients the call is exactly torch's own
(``found_inf`` = 0 only adds a check inside torch's kernel), so results stay bit-identical.
Gradients already checked during backward (:mod:`~optstate_core.step.backward_check`) are not read again.
"""
from __future__ import annotations

from typing import List, TYPE_CHECKING

import torch

from ..state.dtensor import any_distributed
from .backward_check import BackwardCheck
from .gradients import GRAD_OVERFLOW
from .inner import run_inner

if TYPE_CHECKING:  # annotations only
    from .fused_launch import KernelLauncher


def applies(inner, skip_nonfinite: bool, items: List[tuple]) -> bool:
    """Whether ``items`` ((param, state, group index) of a passthrough call) can be skipped on the
    device: NaN/inf skipping on, a fused torch Adam/AdamW, one device, no DTensor (sharded
    parameters agree across ranks through the reference path) and no caller-set found_inf."""
    if not skip_nonfinite or not items or type(inner) not in (torch.optim.Adam, torch.optim.AdamW):
        return False
    if getattr(inner, "found_inf", None) is not None or getattr(inner, "grad_scale", None) is not None:
        return False
    if not all(inner.param_groups[gi].get("fused") for _, _, gi in items):
        return False
    devices = {p.device for p, _, _ in items}
    return len(devices) == 1 and not any_distributed([p for p, _, _ in items])


def run(inner, store, backward_check: BackwardCheck, kernels: KernelLauncher, items: List[tuple]) -> None:
    """Step ``items`` with torch's fused kernel, skipped as a whole on the device when a gradient
    is not finite (the maxima ``backward_check`` took in backward, else read now); adds the skipped
    parameters to the kernels' device counter."""
    known, unknown = backward_check.split([p for p, _, _ in items])
    if not known and not unknown:
        run_inner(inner, items, store)
        return
    if unknown:
        known.append(torch.stack(torch._foreach_norm(unknown, float("inf"))).float())
    maxima = known[0] if len(known) == 1 else torch.cat(known)
    found_inf = (~(maxima < GRAD_OVERFLOW)).any().to(torch.float32)  # NaN too
    inner.found_inf = found_inf
    try:
        run_inner(inner, items, store)
    finally:
        del inner.found_inf
    kernels.add_skipped((found_inf * len(items)).to(torch.int32))
