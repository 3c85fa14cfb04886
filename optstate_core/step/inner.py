"""Running the wrapped torch optimizer's own update on chosen tensors (shadow groups, lent state)."""
from __future__ import annotations

from typing import Dict, List, Optional

import torch

#: torch.optim optimizers whose update is elementwise, so a parameter may be stepped in tiles.
ELEMENTWISE = tuple(getattr(torch.optim, n) for n in (
    "SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Adagrad", "Adadelta", "ASGD", "Rprop")
    if hasattr(torch.optim, n))
#: torch.optim optimizers whose update needs the whole tensor (factored statistics, orthogonalization)
NOT_ELEMENTWISE = tuple(getattr(torch.optim, n) for n in ("Adafactor", "Muon") if hasattr(torch.optim, n))


def group_signature(group: dict) -> tuple:
    """The options of a param group that change which path steps its parameters (and how)."""
    return (group.get("amsgrad"), group.get("maximize"), group.get("differentiable"), group.get("momentum"),
            group.get("nesterov"), isinstance(group.get("lr"), torch.Tensor))


def decoupled_decay(inner: torch.optim.Optimizer, group: dict) -> bool:
    """Whether the group's weight decay is decoupled (AdamW, or Adam with ``decoupled_weight_decay``)."""
    return bool(group.get("decoupled_weight_decay", isinstance(inner, torch.optim.AdamW)))


def unhooked_step(optimizer: torch.optim.Optimizer):
    """The optimizer's ``step`` without torch's hook wrapper (our own step fires the hooks once)."""
    fn = type(optimizer).step
    if getattr(fn, "hooked", False):
        fn = fn.__wrapped__
    return fn


class TileState(dict):
    """The inner optimizer's view of state during a tiled chunk (defaultdict-like, like torch)."""

    def __missing__(self, key):
        value = self[key] = {}
        return value


def run_inner(inner: torch.optim.Optimizer, items, state: Optional[dict] = None) -> None:
    """Run ``inner``'s update on ``(tensor, state dict, group index)`` items.

    The inner optimizer sees shadow copies of the live groups (same hyper-parameters, only these
    tensors), so the shared group dicts are never modified. ``state``: the mapping the inner
    optimizer reads (the real ``optimizer.state``); None lends it each item's own state dict.
    """
    groups_by_index: Dict[int, List[torch.Tensor]] = {}
    for tensor, _, gi in items:
        groups_by_index.setdefault(gi, []).append(tensor)
    shadow = [dict(inner.param_groups[gi], params=ts) for gi, ts in groups_by_index.items()]
    saved_groups, saved_state = inner.param_groups, inner.state
    if state is None:
        state = TileState()
        for tensor, st, _ in items:
            state[tensor] = st
    try:
        inner.param_groups = shadow
        inner.state = state
        unhooked_step(inner)(inner)
    finally:
        inner.param_groups = saved_groups
        inner.state = saved_state
