"""What a fused optimizer declares (:class:`FusedOptimizer`) and its plan for a parameter (:class:`FusedPlan`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from ...state.codecs import Codec, StateKind

#: the kernel forms a moment may take (the fp24 iterate is schedule-free's alone)
MOMENT_FORMS = frozenset({StateKind.FP32, StateKind.BF16, StateKind.INT8, StateKind.INT4})


class FusedOptimizer:
    """One optimizer the Triton kernels step, declared in a file of its own and listed in
    :mod:`.registry`: its state keys, when a parameter group is eligible, the kernel it launches
    and that kernel's arguments (built from a :class:`~optstate_core.step.fused_launch.Launch`)."""

    name = ""  #: the plan's kind: parameters of different kinds never share a launch
    keys: Tuple[str, ...] = ()  #: the state keys, in the kernel's order
    forms: Tuple[frozenset, ...] = (MOMENT_FORMS,)  #: each state's allowed kernel forms (the last repeats)
    master_weights = False  #: the kernel has the master-weight path (bf16 parameters + corr16/corr8)
    loops = False  #: its programs loop over the launch shape's ITERS tiles
    tensor_lr = True  #: the kernel reads a tensor lr (False: a float lr only)

    def matches(self, inner) -> bool:
        """Whether this entry steps ``inner`` (the wrapped torch optimizer)."""
        raise NotImplementedError

    def state_keys(self, group: dict) -> Tuple[str, ...]:
        """The states a parameter of ``group`` keeps (Adam's amsgrad adds one)."""
        return self.keys

    def refusal(self, inner, group: dict) -> Optional[str]:
        """Why ``group``'s parameters go the reference path (the reason logged once), or None."""
        if not self.tensor_lr and isinstance(group["lr"], torch.Tensor):
            return f"{type(inner).__name__} with a tensor lr"
        return None

    def allows(self, kinds: Tuple[StateKind, ...]) -> bool:
        """Whether the kernel takes states of these kernel forms (in the order of the keys)."""
        return all(k in self.forms[min(i, len(self.forms) - 1)] for i, k in enumerate(kinds))

    def torch_fused(self, inner, group: dict, param, kinds, master: int, offload: bool) -> bool:
        """Whether the kernel steps with torch's own fused arithmetic (only Adam/AdamW can)."""
        return False

    def prepare(self, w) -> None:
        """Before a bucket is built: what the kernel reads beside the states (Adam's step tensor)."""

    def shape_kind(self, plan: "FusedPlan") -> str:
        """The ``LAUNCH_SHAPES`` row of a launch: by its most compressed state."""
        return "int8" if StateKind.INT8 in plan.kinds and StateKind.INT4 not in plan.kinds else "other"

    def kernel(self):
        """The Triton kernel (imported on first use: Triton may be missing)."""
        raise NotImplementedError

    def arguments(self, launcher, bucket, launch) -> Tuple[tuple, dict]:
        """The kernel's positional arguments and keywords for one launch over ``bucket``."""
        raise NotImplementedError

    def advance_steps(self, launcher, bucket) -> None:
        """After a bucket's streamed pieces: advance per-parameter step counters (none here)."""

    def __repr__(self) -> str:
        return f"<fused {self.name}>"


@dataclass(frozen=True)
class FusedPlan:
    """How the kernels step one parameter (``FusedPath.plan``); parameters with equal plans share launches."""

    optimizer: FusedOptimizer  #: the registry's entry
    keys: Tuple[str, ...]  #: the state keys
    codecs: Tuple[Codec, ...]  #: each state's codec
    kinds: Tuple[StateKind, ...]  #: each state's kernel form
    first: bool  #: no state yet: the launch allocates and initialises it
    offload: bool  #: some state lives in host memory (streamed through the staging ring)
    host: Tuple[bool, ...]  #: per state (moments, then the correction): in host memory
    master: int = 0  #: master weights: the correction's bits (16, 8), else 0
    master_codec: Optional[Codec] = None  #: the correction's codec (with ``master``)
    torch_fused: bool = False  #: torch's fused Adam/AdamW arithmetic, bit for bit

    @property
    def kind(self) -> str:
        return self.optimizer.name
