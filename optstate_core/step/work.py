"""One step's units of work: a parameter's :class:`Work`, its :class:`Tile` ranges, the step's metrics."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, Optional

import torch

from ..state.dtensor import global_flat_offset, local
from ..policy import ParamInfo
from ..state.store import ParamState, copy_scalar, is_scalar_state


def describe_param(info: ParamInfo) -> str:
    where = f"group {info.group_index}, index {info.index}, shape {tuple(info.shape)}"
    return f"parameter {info.name!r} ({where})" if info.name else f"parameter ({where})"


@dataclass
class StepMetrics:
    """Wall-clock (host) milliseconds per phase of the last step and what it moved."""

    materialize_ms: float = 0.0
    inner_step_ms: float = 0.0
    commit_ms: float = 0.0
    total_ms: float = 0.0
    chunks: int = 0
    tiles: int = 0
    h2d_bytes: int = 0
    d2h_bytes: int = 0
    nonfinite_skipped: int = 0
    peak_materialized_bytes: int = 0  # largest full-precision state decoded at once (one chunk)
    fused_params: int = 0  # parameters stepped by the fused kernels
    kernel_launches: int = 0

    def as_dict(self) -> dict:
        return dict(self.__dict__)


class Work:
    """One parameter's share of a step. ``key`` is the parameter as the groups hold it (maybe a
    DTensor); ``param`` and ``grad`` are the local tensors the math runs on."""

    __slots__ = ("key", "param", "grad", "info", "state", "tiles_left", "dest", "scalars", "new_scalars", "rows",
                 "cols", "offset")

    def __init__(self, param, info, state):
        self.key = param
        self.param = local(param)
        self.grad = local(param.grad)
        self.info = info
        self.state: ParamState = state
        self.rows, self.cols = _slab(self.param.shape)
        self.offset = global_flat_offset(param)  # first local element's index in the global tensor
        self.tiles_left = 0
        self.dest: Dict[str, object] = {}
        self.scalars = {k: copy_scalar(v) for k, v in state.items() if is_scalar_state(v)}
        self.new_scalars: Dict[str, object] = {}


def _slab(shape):
    numel = math.prod(shape)
    rows = shape[0] if len(shape) >= 2 else 1
    return rows, (numel // rows if rows else 0)


@dataclass
class Tile:
    """A flat element range ``[start, stop)`` of one parameter, as a 2-D slab region."""

    work: Work
    start: int
    stop: int
    r0: int
    r1: int
    c0: int
    c1: int
    whole: bool
    tensor: Optional[torch.Tensor] = None
    states: Dict[str, object] = field(default_factory=dict)
    master: Optional[torch.Tensor] = None  # the bf16 view while ``tensor`` is the fp32 master

    @property
    def numel(self) -> int:
        return self.stop - self.start

    @property
    def slab_shape(self):
        return (self.r1 - self.r0, self.c1 - self.c0)
