"""What the step paths are given: :class:`StepContext` (the run's facts) and the typed seams onto
the schedule room (:class:`Residency`, :class:`Conformance`, :class:`Transfers`).

The engine (``schedule/engine.py``) builds one context and hands each collaborator here the
context and the seams it uses, never itself: a path reads the wrapped optimizer, its state, the
policy, the options, the step count and this step's metrics from the context, and asks where a
state lives, how it is re-stored and how it crosses to the device through the seams, which the
schedule room implements (``placement.py``, ``conform.py``, ``transfer.py``).
"""
from __future__ import annotations

from typing import Dict, Iterator, List, Optional, Protocol, Tuple

import torch

from ..policy import ParamInfo, Policy
from ..state.store import StateMap
from .work import StepMetrics, Work


class StepContext:
    """One wrapped optimizer's run: its inner optimizer, state, policy, options (a
    :class:`~optstate_core.options.WrapOptions`), parameter names, the step count and the
    current step's metrics. The engine advances the count and starts new metrics."""

    def __init__(self, inner: torch.optim.Optimizer, store: StateMap, policy: Policy, options,
                 names: Dict[int, str]):
        self.inner = inner
        self.store = store
        self.policy = policy
        self.options = options
        self.names = names
        self.step_count = 0
        self.metrics = StepMetrics()

    def param_infos(self) -> Iterator[Tuple[torch.Tensor, ParamInfo]]:
        """``(param, ParamInfo)`` for every parameter of the live groups, in checkpoint order."""
        index = 0
        for gi, group in enumerate(self.inner.param_groups):
            names = group.get("param_names")
            for j, p in enumerate(group["params"]):
                name = names[j] if names and j < len(names) else self.name_of(p)
                yield p, ParamInfo(index, gi, tuple(p.shape), p.dtype, name)
                index += 1

    def name_of(self, p) -> Optional[str]:
        """``wrap(named_parameters=...)`` first, then names the policy learned (``bind_names``)."""
        name = self.names.get(id(p))
        if name is None and hasattr(self.policy, "name_of"):
            name = self.policy.name_of(p)
        return name

    def pins(self, device: torch.device) -> bool:
        """Whether host-tier state of a parameter on ``device`` is pinned (``pin_memory``; by default on CUDA)."""
        pin_memory = self.options.pin_memory
        return pin_memory if pin_memory is not None else device.type == "cuda"


class Residency(Protocol):
    """Codec and tier of each state at a step, residency under a GPU budget, the staging ring's size."""

    def codec_of(self, w: Work, key: str, step: int): ...

    def tier_of(self, w: Work, key: str, step: int) -> str: ...

    def assign_residency(self, works: List[Work], step: int) -> None: ...

    def staging_size(self, device: torch.device) -> int: ...


class Conformance(Protocol):
    """Whether a parameter's stored state differs from the form wanted now, and where it goes."""

    def needs_tiles(self, w: Work) -> bool: ...

    def preallocate(self, works: List[Work]) -> None: ...

    def destination(self, w: Work, key: str, value: torch.Tensor): ...


class Transfers(Protocol):
    """Copies of host-tier payloads to the device and back (counted)."""

    def fetch(self, payload: Dict[str, torch.Tensor], device: torch.device) -> Dict[str, torch.Tensor]: ...

    def put(self, src: Dict[str, torch.Tensor], dst: Dict[str, torch.Tensor]) -> None: ...
