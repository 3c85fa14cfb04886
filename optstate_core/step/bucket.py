"""A bucket: the parameters of one kernel launch (same group, codecs, dtype, layout) and their tables."""
from __future__ import annotations

from operator import attrgetter, methodcaller

import torch

from ..state.codecs import EncodedTensor
from ..state.dtensor import is_dtensor, local
from .kernels import launch

_DATA_PTR, _GRAD = methodcaller("data_ptr"), attrgetter("grad")


def _tiles(rows, cols) -> int:
    """256-element tiles of slabs ``rows[i] x cols[i]`` (each row a whole number of tiles)."""
    return sum(r * -(-c // launch.TILE) for r, c in zip(rows, cols))


def aligned_layout(p: torch.Tensor) -> bool:
    """Rows are whole 256-element tiles and offsets fit in int32: the kernels' fast layout."""
    rows = p.shape[0] if p.dim() >= 2 else 1
    return p.numel() % rows == 0 and (p.numel() // max(rows, 1)) % 256 == 0 and p.numel() < 2**31 - 2**20


class Bucket:
    """One kernel launch's worth of parameters (same group, codecs, dtype, layout)."""

    def __init__(self, works, storages, plan):
        self.keys = [w.key for w in works]
        self.params = [w.param for w in works]
        self.states = [w.state for w in works]
        self.indices = [w.info.index for w in works]
        self.group_index = works[0].info.group_index
        self.shapes = [tuple(p.shape) for p in self.params]
        self.rows = [w.rows for w in works]
        self.cols = [w.cols for w in works]
        self.bases = [w.offset for w in works]  # index of each item's first element in its global tensor
        self.offsets = [0] * len(works)  # byte offset of each item's rows in its parameter and gradient
        self.storages = storages
        self.plan = plan
        self.first = plan.first
        self.tiles = _tiles(self.rows, self.cols)  # 256-element tiles of the launch
        self.aligned = aligned_layout(self.params[0])
        self.whole = self._is_whole()
        self._tables = {}  # stream key -> this bucket's cached tables on that stream (see memo)
        self._param_index = None
        self.parent_order = False  # a piece bucket whose item t is the parent's parameter t

    def param_pointers(self):
        """Addresses of the items' parameter rows (read each launch: ``p.data`` may be replaced)."""
        if self.whole:
            return list(map(_DATA_PTR, self.params))
        return [p.data_ptr() + off for p, off in zip(self.params, self.offsets)]

    def grad_pointers(self):
        """Addresses of the items' current gradient rows (new tensors every step, maybe)."""
        if self.whole:
            return list(map(_DATA_PTR, map(_GRAD, self.keys)))
        return [local(k.grad).data_ptr() + off for k, off in zip(self.keys, self.offsets)]

    def _is_whole(self) -> bool:
        """Every item is a whole plain tensor (no row offsets, no DTensor shards): pointers then
        come straight from the parameters and gradients (the per-step path of most launches)."""
        return not any(self.offsets) and not any(map(is_dtensor, self.keys))

    def memo(self, device) -> dict:
        """This bucket's cached device tables for the current stream of ``device`` (tables are
        only read on the stream they were allocated on: kernels/launch.py)."""
        key = launch.stream_key(device)
        memo = self._tables.get(key)
        if memo is None:
            memo = self._tables[key] = {}
        return memo

    def param_index(self, device):
        """For a piece bucket: each piece's parameter index in the parent bucket (device table)."""
        return launch.cached_table(self._param_index, device)

    def sub(self, pieces, storages) -> "Bucket":
        """The same launch over row pieces ``(i, r0, r1)`` of its parameters, with other state
        storages (the staged copies; None: set by :meth:`point_states`); ``params`` are the
        whole parameters, their rows' offsets in ``offsets``."""
        sub = object.__new__(Bucket)
        sub.keys = [self.keys[i] for i, _, _ in pieces]
        sub.params = [self.params[i] for i, _, _ in pieces]
        sub.offsets = [r0 * self.cols[i] * self.params[i].element_size() for i, r0, _ in pieces]
        sub.states = [self.states[i] for i, _, _ in pieces]
        sub.indices = [self.indices[i] for i, _, _ in pieces]
        sub.shapes = [(r1 - r0, self.cols[i]) for i, r0, r1 in pieces]
        sub.rows = [r1 - r0 for _, r0, r1 in pieces]
        sub.cols = [self.cols[i] for i, _, _ in pieces]
        sub.bases = [self.bases[i] + r0 * self.cols[i] for i, r0, _ in pieces]
        sub.group_index, sub.plan, sub.first, sub.aligned = self.group_index, self.plan, self.first, self.aligned
        sub.tiles = _tiles(sub.rows, sub.cols)
        sub.whole = sub._is_whole()
        sub.storages = storages
        sub._tables = {}
        sub._param_index = [i for i, _, _ in pieces]
        sub.parent_order = sub._param_index == list(range(len(self.params)))
        return sub

    def host_states(self, master_only: bool = False):
        """Indices (into each parameter's storages) of the states kept in host memory, which
        stream through the staging ring; ``master_only``: just the master-weight correction."""
        host = self.plan.host
        if master_only:
            k = len(self.plan.keys)
            return [k] if self.plan.master and k < len(host) and host[k] else []
        return [k for k, on_host in enumerate(host) if on_host]

    def resident_rows(self, i: int, k: int, r0: int, r1: int):
        """Rows ``r0:r1`` of parameter ``i``'s resident state ``k`` (in place, for a streamed piece)."""
        value = self.storages[i][k]
        if isinstance(value, EncodedTensor):
            return EncodedTensor(value.codec, {n: t[r0:r1] for n, t in value.payload.items()},
                                 (r1 - r0, self.cols[i]), value.dtype)
        return value.view(self.rows[i], self.cols[i])[r0:r1]

    def point_states(self, pointers) -> None:
        """Point the launch's state tables at these addresses: per state, each item's main payload
        and scales (0: none), for staged copies that have no views (stage_plan.staged_pointers)."""
        device = self.params[0].device
        keys = list(pointers)
        tables = launch.cached_tables([values for k in keys for values in pointers[k]], device)  # one copy
        memo = self.memo(device)
        for j, k in enumerate(keys):
            memo[k] = (tables[2 * j], tables[2 * j + 1])

    def piece_bytes(self, piece) -> int:
        """Staged bytes of a piece: its host states' rows, each payload padded to 16 bytes."""
        i, r0, r1 = piece
        return sum(-(-t[r0:r1].numel() * t.element_size() // 16) * 16
                   for k in self.host_states() for t in self.storages[i][k].payload.values())

    def chunks(self, idx, capacity: int):
        """Consecutive row pieces of parameters ``idx`` grouped so that each group's staged
        state fits ``capacity`` bytes; a parameter too large for one group is split by rows."""
        out, cur, used = [], [], 0
        for i in idx:
            total = self.piece_bytes((i, 0, self.rows[i]))
            per_row = max(1, -(-total // max(self.rows[i], 1)))
            r = 0
            while r < self.rows[i]:
                room = capacity - used
                take = min(self.rows[i] - r, max(room // per_row, 0))
                if take <= 0:
                    if cur:
                        out.append(cur)
                        cur, used = [], 0
                        continue
                    take = min(self.rows[i] - r, max(1, capacity // per_row))
                piece = (i, r, r + take)
                cur.append(piece)
                used += self.piece_bytes(piece)
                r += take
        if cur:
            out.append(cur)
        return out

    def tables(self, i: int, device, memo):
        """Pointer tables (data, scales) of the i-th state of every parameter, kept in ``memo``
        (:meth:`memo` of the current stream, which the launch holds: one stream query per launch;
        built once: the engine re-plans whenever a state object changes)."""
        if i not in memo:
            memo[i] = self._build_tables(i, device)
        return memo[i]

    def _build_tables(self, i: int, device):
        values = [s[i] for s in self.storages]
        if isinstance(values[0], EncodedTensor):
            if "hi" in values[0].payload:  # fp24: bf16 values and their int8 residuals
                return (launch.pointer_table([v.payload["hi"] for v in values], device),
                        launch.pointer_table([v.payload["lo"] for v in values], device))
            name = "codes" if "codes" in values[0].payload else "data"
            return (launch.pointer_table([v.payload[name] for v in values], device),
                    launch.pointer_table([v.payload.get("scales") for v in values], device))
        return launch.pointer_table(values, device), launch.pointer_table([None] * len(values), device)

    def steps_table(self, device, memo):
        """Pointer table of every parameter's step counter, kept in ``memo`` (as :meth:`tables`)."""
        if "steps" not in memo:
            memo["steps"] = launch.pointer_table([st["step"] for st in self.states], device)
        return memo["steps"]
