"""Which subsets of its parameters a wrapped optimizer may be called on: its step granularity.

- ``"elementwise"``: any element range of a parameter (torch.optim's Adam family, SGD, Lion):
  state is decoded tile by tile, so the full-precision state alive at once stays bounded.
- ``"tensor"``: whole tensors, several calls per step (Adafactor, Muon, CAME: factored or
  orthogonalised state).
- ``"step"``: one call over every parameter per step (anything unknown): reductions over all
  parameters (Prodigy's step-size estimate) and values the optimizer keeps in its groups
  (schedule-free's ``k``, Prodigy's ``d``) see what the unwrapped optimizer sees; the decoded state
  of every parameter is alive during that call.

A class is finer than ``"step"`` only when :data:`REGISTRY` says so (each entry has a test) or the
user says so, and a user's word is checked against the whole-step result on the first steps
(:func:`check_against_whole`).
"""
from __future__ import annotations

import copy
from typing import List, Optional, Tuple

import torch

GRANULARITIES = ("elementwise", "tensor", "step")

#: ``module.QualifiedName`` of an optimizer class -> its granularity (classes are not imported:
#: third-party packages need not be installed). A subclass inherits the entry only if it keeps
#: the registered class's ``step``.
REGISTRY = {
    **{f"{getattr(torch.optim, n).__module__}.{n}": "elementwise" for n in (
        "SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Adagrad", "Adadelta", "ASGD", "Rprop")},
    **{f"{getattr(torch.optim, n).__module__}.{n}": "tensor" for n in ("Adafactor", "Muon") if hasattr(torch.optim, n)},
    "lion_pytorch.lion_pytorch.Lion": "elementwise",
    "came_pytorch.CAME.CAME": "tensor",
}

#: steps (counted from 0) on which a granularity the user declared is checked
CHECKED_STEPS = 2


def qualified_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def registered(optimizer: torch.optim.Optimizer) -> Optional[str]:
    """The registry's granularity for this optimizer's class (or a base whose ``step`` it keeps)."""
    step = type(optimizer).step
    for cls in type(optimizer).__mro__:
        entry = REGISTRY.get(qualified_name(cls))
        if entry is not None:
            return entry if cls.step is step else None
    return None


def resolve(optimizer: torch.optim.Optimizer, granularity: Optional[str],
            elementwise: Optional[bool]) -> Tuple[str, bool]:
    """``(granularity, checked)``: the user's choice (``elementwise=True/False`` is the older
    spelling of ``"elementwise"``/``"tensor"``) or the registry's, else ``"step"``; ``checked``
    when the user's choice is finer than ``"step"`` for a class the registry does not know, so the
    first steps compare it with a whole step. A choice finer than the registry's entry is refused."""
    if granularity is not None and granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be None or one of {', '.join(GRANULARITIES)}, got {granularity!r}")
    if elementwise is not None and not isinstance(elementwise, bool):
        raise ValueError(f"elementwise must be None, True or False, got {elementwise!r}")
    if elementwise is not None:
        spelled = "elementwise" if elementwise else "tensor"
        if granularity is not None and granularity != spelled:
            raise ValueError(f"elementwise={elementwise} contradicts granularity={granularity!r}")
        granularity = spelled
    known = registered(optimizer)
    if granularity is None:
        return known or "step", False
    if known is not None and _finer(granularity, known):
        said = f"elementwise={elementwise}" if elementwise is not None else f"granularity={granularity!r}"
        raise ValueError(f"{said}: {type(optimizer).__name__}'s update needs whole tensors (factored statistics or "
                         f"an orthogonalization), so its parameters cannot be stepped in {granularity} pieces")
    return granularity, _finer(granularity, known or "step")


def _finer(a: str, b: str) -> bool:
    return GRANULARITIES.index(a) < GRANULARITIES.index(b)


def check_against_whole(optimizer: torch.optim.Optimizer, granularity: str, params, states) -> Optional[str]:
    """Run the optimizer's own update twice on copies (nothing real changes): once over every
    parameter in one call, once split as ``granularity`` allows (each tensor alone; elementwise:
    each half of each tensor alone). Returns what differs, or None when parameters, state and
    group values agree bit for bit. ``params``: the parameters with gradients; ``states``: their
    decoded full-precision state dicts."""
    from .inner import run_inner, unhooked_step
    saved_attrs = dict(optimizer.__dict__)
    state_of = {id(p): st for p, st in zip(params, states)}
    real_groups = optimizer.param_groups

    def copies():
        groups, items = [], []
        for gi, g in enumerate(real_groups):
            group = {k: copy.deepcopy(v) for k, v in g.items() if k != "params"}
            group["params"] = []
            for p in g["params"]:
                if id(p) not in state_of:
                    continue
                c = p.detach().clone()
                c.grad = p.grad.detach().clone()
                group["params"].append(c)
                items.append((c, copy.deepcopy(state_of[id(p)]), gi))
            groups.append(group)
        return groups, items

    try:
        whole_groups, whole_items = copies()
        optimizer.param_groups, optimizer.state = whole_groups, {c: st for c, st, _ in whole_items}
        with torch.no_grad():
            unhooked_step(optimizer)(optimizer)
        split_groups, split_items = copies()
        with torch.no_grad():
            for i, (c, st, gi) in enumerate(split_items):
                pieces = _pieces(c, st, granularity)
                for t, piece_state in pieces:
                    run_inner(optimizer, [(t, piece_state, gi)], groups=split_groups)
                    optimizer.__dict__.update({k: v for k, v in saved_attrs.items()
                                               if k not in ("param_groups", "state")})
                split_items[i] = (c, _joined(c, pieces), gi)
    finally:
        optimizer.__dict__.clear()
        optimizer.__dict__.update(saved_attrs)
    for i, ((a, sa, gi), (b, sb, _)) in enumerate(zip(whole_items, split_items)):
        where = f"the {i}th parameter with a gradient (group {gi}, shape {tuple(a.shape)})"
        if not torch.equal(a, b):
            return f"{where} differs after the step"
        for key in set(sa) | set(sb):
            va, vb = sa.get(key), sb.get(key)
            if isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor) and va.numel() == vb.numel():
                vb = vb.reshape(va.shape)  # an elementwise split joins its pieces flat
            if not _same_value(va, vb):
                return f"state {key!r} of {where} differs after the step"
    for gi, (ga, gb) in enumerate(zip(whole_groups, split_groups)):
        for key in ga:
            if key != "params" and not _same_value(ga[key], gb.get(key)):
                return f"group {gi}'s {key!r} differs after the step ({ga[key]!r} in one call, {gb.get(key)!r} split)"
    return None


def _same_value(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    try:
        return bool(a == b)
    except Exception:  # values that do not compare (arrays): the same object only
        return a is b


def _pieces(param: torch.Tensor, state: dict, granularity: str) -> List[tuple]:
    """``(tensor, state)`` pieces of one parameter for the split run: the whole tensor, or for an
    elementwise update its two flat halves, each with its own dict of state views."""
    n = param.numel()
    if granularity != "elementwise" or n < 2 or not all(
            not isinstance(v, torch.Tensor) or v.dim() == 0 or v.shape == param.shape for v in state.values()):
        return [(param, state)]
    flat, grad, cut = param.view(-1), param.grad.view(-1), n // 2
    pieces = []
    for lo, hi in ((0, cut), (cut, n)):
        t = flat[lo:hi]
        t.grad = grad[lo:hi]
        pieces.append((t, {k: (v.reshape(-1)[lo:hi].clone() if isinstance(v, torch.Tensor) and v.dim() else
                               copy.deepcopy(v)) for k, v in state.items()}))
    return pieces


def _joined(param: torch.Tensor, pieces: List[tuple]) -> dict:
    """The whole parameter's state from its pieces' (tensors joined, scalars from the first piece)."""
    if len(pieces) == 1:
        return pieces[0][1]
    out = {}
    for key, value in pieces[0][1].items():
        if isinstance(value, torch.Tensor) and value.dim():
            out[key] = torch.cat([st[key].reshape(-1) for _, st in pieces]).view(param.shape)
        else:
            out[key] = value
    return out
