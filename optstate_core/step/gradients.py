"""Gradient checks before a step: validate every gradient first (nothing changes on a rejected
step) and find the parameters whose gradient holds NaN/inf or overflows (the reference paths' skip)."""
from __future__ import annotations

from typing import Dict, Iterable, List, Tuple

import torch

from ..state.dtensor import agree_on_flags, any_distributed
from ..policy import ParamInfo
from ..state.store import ParamState, StateMap
from .work import Work, describe_param

#: skip_nonfinite also skips a gradient this large: its square (Adam's second moment) overflows
#: fp32 to inf, after which the parameter never moves again (torch) or its compressed state
#: saturates and the next update explodes. The fused kernels (kernels/common.py block_skip) and the passthrough skip use the same.
GRAD_OVERFLOW = 2.0 ** 64


def collect(param_infos: Iterable[Tuple[torch.Tensor, ParamInfo]], state: StateMap) -> List[Work]:
    """Validate every gradient, then return the work of this step (nothing changed yet)."""
    works = []
    for p, info in param_infos:
        g = p.grad
        if g is None:
            continue
        if g.is_sparse or g.layout != torch.strided:
            raise ValueError(f"{describe_param(info)} has a sparse gradient; optstate keeps dense state only. "
                             "Step it with an unwrapped optimizer that supports sparse gradients.")
        if g.shape != p.shape:
            raise ValueError(f"{describe_param(info)} has a gradient of shape {tuple(g.shape)}")
        if g.is_complex() != p.is_complex():
            raise ValueError(f"{describe_param(info)}: gradient and parameter disagree on being complex")
        works.append(Work(p, info, state[p] if p in state else ParamState()))
    return works


def split_nonfinite(works: List[Work], empty_shards_agree: bool = False) -> Tuple[List[Work], List[Work]]:
    """``(finite, nonfinite)`` works by their gradients; one host synchronisation per device.
    Under FSDP2 a shard's NaN marks the parameter on every rank: the ranks all-reduce one flag per
    work, so their works must line up. ``empty_shards_agree``: every rank steps these works on the
    reference path (the CPU), so a rank's empty shards (FSDP2 gives a rank none of a tensor with
    fewer rows than ranks) take part too, with flag 0, in one all-reduce; else (the kernels' devices,
    where only a rank holding none of a parameter steps it here) they stay out."""
    by_device: Dict[torch.device, List[int]] = {}
    for i, w in enumerate(works):
        if w.grad.numel():
            by_device.setdefault(w.grad.device, []).append(i)
    distributed = any_distributed([w.key for w in works])
    if distributed and empty_shards_agree:  # one flag per work on every rank, empty shards' 0 included
        flags = torch.zeros(len(works), dtype=torch.int32, device=works[0].grad.device)
        for idx in by_device.values():
            flags[idx] = (~finite_flags([works[i].grad for i in idx])).to(flags.device, torch.int32)
        finite = [not flag for flag in agree_on_flags(flags).tolist()]  # the step's one sync
    else:
        finite = [True] * len(works)
        for idx in by_device.values():
            bad = (~finite_flags([works[i].grad for i in idx])).to(torch.int32)
            if distributed:
                bad = agree_on_flags(bad)
            for i, flag in zip(idx, bad.tolist()):  # the step's one sync
                finite[i] = not flag
    return [w for w, ok in zip(works, finite) if ok], [w for w, ok in zip(works, finite) if not ok]


def all_finite(grads) -> bool:
    """Whether every gradient is free of NaN/inf and below GRAD_OVERFLOW (one sync per device)."""
    by_device: Dict[torch.device, list] = {}
    for g in grads:
        if g.numel():
            by_device.setdefault(g.device, []).append(g)
    for gs in by_device.values():
        if not bool(finite_flags(gs).all()):
            return False
    return True


def finite_flags(grads: List[torch.Tensor]) -> torch.Tensor:
    """True per gradient (all on one device, none empty) that holds no NaN/inf and no value of
    magnitude >= GRAD_OVERFLOW. On the CPU from the smallest and largest values, one pass per
    gradient (NaN propagates through both): ~30x faster there than the infinity norm, which the
    other devices use."""
    if grads[0].device.type == "cpu" and not any(g.is_complex() for g in grads):
        extremes = torch.stack([torch.stack(torch.aminmax(g)).float() for g in grads])
        return (extremes.abs() < GRAD_OVERFLOW).all(dim=1)  # NaN compares false
    return torch.stack([n.float() for n in torch._foreach_norm(grads, float("inf"))]) < GRAD_OVERFLOW
