"""Running the wrapped torch optimizer's own update on chosen tensors (its real groups, lent state)."""
from __future__ import annotations

from typing import Dict, List, Optional

import torch

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


def run_inner(inner: torch.optim.Optimizer, items, state: Optional[dict] = None, groups=None) -> None:
    """Run ``inner``'s update on ``(tensor, state dict, group index)`` items.

    The inner optimizer sees its real group dicts (what it writes there, a ``step`` or an estimate,
    persists), each holding only these tensors for the call: the ``params`` lists are swapped in
    and put back. ``state``: the mapping the inner optimizer reads (the real ``optimizer.state``);
    None lends it each item's own state dict. ``groups``: the group dicts to use (default: the
    inner optimizer's own).
    """
    groups = inner.param_groups if groups is None else groups
    tensors_by_group: Dict[int, List[torch.Tensor]] = {}
    for tensor, _, gi in items:
        tensors_by_group.setdefault(gi, []).append(tensor)
    chosen = [groups[gi] for gi in tensors_by_group]
    saved_params = [g["params"] for g in chosen]
    saved_groups, saved_state = inner.param_groups, inner.state
    if state is None:
        state = TileState()
        for tensor, st, _ in items:
            state[tensor] = st
    try:
        for g, tensors in zip(chosen, tensors_by_group.values()):
            g["params"] = tensors
        inner.param_groups = chosen
        inner.state = state
        unhooked_step(inner)(inner)
    finally:
        for g, params in zip(chosen, saved_params):
            g["params"] = params
        inner.param_groups = saved_groups
        inner.state = saved_state
