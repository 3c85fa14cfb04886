"""Cached staging layouts of streamed state: where a bucket's state rows sit in a flat device
buffer, the host byte ranges that copy there, and a streamed bucket's ring chunks, built once and
reused every step (the host cost of an offloaded step is Python work per parameter and payload:
done once per plan, not once per step).

A :class:`Layout` places the state rows of some row pieces of a bucket like the host arena
(per state, per payload, pieces in order, each 16-byte padded), so adjacent host rows map to
adjacent buffer bytes. A :class:`ChunkPlan` is one ring chunk of a streamed bucket: its layout,
its staged views at its ring offset, its coalesced copies and its launch (a sub-bucket whose
pointer tables stay cached); :func:`ring_chunks` keeps a bucket's chunk plans while the same
parameters stream. Parameters prefetched during backward are staged in slabs
(:class:`SlabPlan`): several whole parameters of a bucket in one allocation, laid out in arena
order so that their copies coalesce into a few long ranges each way; the kernel reads them at
the slab's address + cached offsets.
"""
from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import torch

from ..state.codecs import EncodedTensor
from .transfer import coalesce_copies

PAD = 16


def _padded(n: int) -> int:
    return -(-n // PAD) * PAD


class Layout:
    """Byte offsets of the state rows of ``pieces`` (``(i, r0, r1)``) of a bucket in a flat buffer
    (from 0), plus flat byte views of the host rows (built once; the host arena does not move
    while the bucket's plan stands)."""

    __slots__ = ("pieces", "nbytes", "slots", "hosts", "offsets", "sizes", "sources", "resident", "_pointers")

    def __init__(self, bucket, pieces: Sequence[Tuple[int, int, int]]):
        self.pieces = list(pieces)
        self.slots = []  # (piece position, state index, payload name, byte offset, host rows)
        off = 0
        for k in bucket.host_states():  # a state that stays resident (mixed tiers) is used in place
            for name in bucket.storages[self.pieces[0][0]][k].payload:
                for j, (i, r0, r1) in enumerate(self.pieces):
                    rows = bucket.storages[i][k].payload[name][r0:r1]
                    self.slots.append((j, k, name, off, rows))
                    off += _padded(rows.numel() * rows.element_size())
        self.nbytes = off
        copied = [(off, rows) for _, _, _, off, rows in self.slots if rows.numel()]
        self.hosts = [rows.reshape(-1).view(torch.uint8) for _, rows in copied]
        self.offsets = [off for off, _ in copied]
        self.sizes = [h.numel() for h in self.hosts]
        self.sources = [list(bucket.storages[i]) for i, _, _ in self.pieces]
        staged = set(bucket.host_states())
        self.resident = [[None if k in staged else bucket.resident_rows(i, k, r0, r1) for k in range(len(src))]
                         for (i, r0, r1), src in zip(self.pieces, self.sources)]
        self._pointers = None

    def encoded(self, bucket, buffer: torch.Tensor, start: int) -> List[List[EncodedTensor]]:
        """The staged state of each piece as encoded views of ``buffer`` from byte ``start``."""
        views = [[dict() for _ in bucket.storages[i]] for i, _, _ in self.pieces]
        for j, k, name, off, rows in self.slots:
            n = rows.numel() * rows.element_size()
            views[j][k][name] = buffer[start + off:start + off + n].view(rows.dtype).view(rows.shape)
        return [[EncodedTensor(enc.codec, views[j][k], (r1 - r0, bucket.cols[i]), enc.dtype) if views[j][k]
                 else self.resident[j][k] for k, enc in enumerate(bucket.storages[i])]
                for j, (i, r0, r1) in enumerate(self.pieces)]

    def byte_views(self, buffer: torch.Tensor) -> List[torch.Tensor]:
        """Flat byte views of ``buffer`` matching :attr:`hosts` (a staged copy of its own)."""
        return [buffer[o:o + n] for o, n in zip(self.offsets, self.sizes)]

    def pointer_offsets(self) -> Dict[int, Tuple[list, list]]:
        """Per state: each piece's main payload ("codes", else "data") and "scales" as
        :meth:`Bucket.tables` would point at them: a byte offset into the staged buffer (int), an
        absolute address for a resident state (``("at", address)``), None for no scales."""
        if self._pointers is None:
            where = {(j, k, name): off for j, k, name, off, _ in self.slots}
            out = {}
            for k, enc0 in enumerate(self.sources[0]):
                mains, scales = [], []
                for j in range(len(self.pieces)):
                    value = self.resident[j][k]
                    if value is None:
                        main = "codes" if "codes" in enc0.payload else "data"
                        mains.append(where[(j, k, main)])
                        scales.append(where.get((j, k, "scales")))
                    elif isinstance(value, EncodedTensor):
                        main = "codes" if "codes" in value.payload else "data"
                        mains.append(("at", value.payload[main].data_ptr()))
                        s = value.payload.get("scales")
                        scales.append(None if s is None else ("at", s.data_ptr()))
                    else:
                        mains.append(("at", value.data_ptr()))
                        scales.append(None)
                out[k] = (mains, scales)
            self._pointers = out
        return self._pointers


class ChunkPlan:
    """One ring chunk of a streamed bucket: its layout, its ring offset, and (built at that
    offset) its coalesced host/ring copies and its launch, a sub-bucket whose tables stay cached."""

    def __init__(self, bucket, pieces):
        self.layout = Layout(bucket, pieces)
        self.pieces = self.layout.pieces
        self.start = None
        self.buffer = None
        self.pairs: List[Tuple[torch.Tensor, torch.Tensor]] = []
        self._raw = []  # (state index, host rows, staged rows) before coalescing
        self.moved = 0
        self.sub = None

    def place(self, bucket, buffer: torch.Tensor, start: int) -> None:
        """Views, copies and launch at ``start`` of ``buffer`` (rebuilt only when they moved)."""
        if start == self.start and buffer is self.buffer:
            return
        staged = self.layout.encoded(bucket, buffer, start)
        self._raw = [(k, rows, staged[j][k].payload[name]) for j, k, name, _, rows in self.layout.slots]
        # layout order is (state, payload, piece): runs of adjacent rows merge into one copy
        self.pairs, self.moved = _coalesced([(h, d) for _, h, d in self._raw])
        self.sub = bucket.sub(self.pieces, staged)
        self.start, self.buffer = start, buffer

    def uploads(self, bucket):
        """(copies, bytes) that upload the chunk: every host state, or on a first step (fresh
        moments are written, not read) only a master-weight correction's."""
        if not bucket.first:
            return self.pairs, self.moved
        states = set(bucket.host_states(master_only=True))
        return _coalesced([(h, d) for k, h, d in self._raw if k in states])

    def launch_bucket(self, bucket):
        """The chunk's launch (its tables cached; parameter and gradient addresses are read at
        launch), with the bucket's first-step flag."""
        self.sub.first = bucket.first
        return self.sub


def _coalesced(pairs):
    """(coalesced copies, bytes they move) of (host, staged) pairs."""
    merged = coalesce_copies(pairs)
    return merged, sum(h.numel() * h.element_size() for h, _ in merged)


def ring_chunks(bucket, indices: List[int], capacity: int) -> List[ChunkPlan]:
    """The chunk plans that stream parameters ``indices`` of ``bucket`` through chunks of at
    most ``capacity`` bytes, kept on the bucket while the same parameters stream; a step that streams another set (a partial prefetch) gets its own entry."""
    return _kept(bucket, "_ring_chunks", (tuple(indices), capacity),
                 lambda: [ChunkPlan(bucket, chunk) for chunk in bucket.chunks(indices, capacity)])


def param_bytes(bucket, i: int) -> int:
    """Staged bytes of parameter ``i``'s whole state rows (16-byte padded payloads), cached."""
    return _kept(bucket, "_param_bytes", i, lambda: bucket.piece_bytes((i, 0, bucket.rows[i])), limit=None)


class SlabPlan:
    """Whole parameters ``indices`` of a bucket staged together in one device allocation: their
    :class:`Layout` in arena order (adjacent host rows stay adjacent) and its copies merged into
    byte ranges ``(host bytes, offset, nbytes)``; per parameter, its own ranges (for a partial
    write-back) and its piece position (for the kernel's pointers)."""

    __slots__ = ("indices", "layout", "ranges", "piece_ranges", "piece_of", "piece_moved", "moved")

    def __init__(self, bucket, indices: Sequence[int]):
        self.indices = sorted(indices)
        self.layout = Layout(bucket, [(i, 0, bucket.rows[i]) for i in self.indices])
        self.piece_of = {i: j for j, i in enumerate(self.indices)}
        slots = [(j, off, rows.reshape(-1).view(torch.uint8)) for j, _, _, off, rows in self.layout.slots
                 if rows.numel()]
        self.ranges = _merged_ranges([(off, host) for _, off, host in slots])
        self.piece_ranges = [_merged_ranges([(off, host) for j, off, host in slots if j == piece])
                             for piece in range(len(self.indices))]
        # state bytes each way (the merged copies also carry the 16-byte padding between payloads)
        self.piece_moved = [sum(host.numel() for j, _, host in slots if j == piece)
                            for piece in range(len(self.indices))]
        self.moved = sum(self.piece_moved)

    def copies(self, buffer: torch.Tensor, pieces=None):
        """(host byte views, matching views of ``buffer``, state bytes) of the whole slab, or of
        ``pieces`` only."""
        if pieces is None:
            ranges, moved = self.ranges, self.moved
        else:
            ranges = [r for j in pieces for r in self.piece_ranges[j]]
            moved = sum(self.piece_moved[j] for j in pieces)
        return [h for h, _, _ in ranges], [buffer[o:o + n] for _, o, n in ranges], moved


def _merged_ranges(slots):
    """``(offset, host bytes)`` slots in layout order -> ``(host bytes, offset, nbytes)`` ranges,
    merging a slot into the previous one when both sides continue it (up to the 16-byte padding)."""
    out = []
    for off, host in slots:
        n = host.numel()
        if out:
            prev, poff, pn = out[-1]
            hs, ps = host.storage_offset(), prev.storage_offset()
            gap = -(-pn // PAD) * PAD
            if (host.untyped_storage().data_ptr() == prev.untyped_storage().data_ptr() and hs == ps + gap
                    and off == poff + gap):
                out[-1] = (_host_bytes(prev, ps, gap + n), poff, gap + n)
                continue
        out.append((host, off, n))
    return out


def _host_bytes(like: torch.Tensor, start: int, nbytes: int) -> torch.Tensor:
    """A flat uint8 view of ``nbytes`` bytes of ``like``'s storage from byte ``start``."""
    return torch.empty(0, dtype=torch.uint8, device=like.device).set_(like.untyped_storage(), start, (nbytes,))


def slab_plan(bucket, indices: Sequence[int]) -> SlabPlan:
    """The slab plan of parameters ``indices`` of ``bucket``, kept while the same set is staged."""
    key = tuple(sorted(indices))
    return _kept(bucket, "_slab_plans", key, lambda: SlabPlan(bucket, key), limit=64)


def staged_launch(bucket, indices: List[int], entries):
    """The launch over parameters ``indices`` of ``bucket`` whose state was staged in backward
    (``entries``, in slabs): kept on the bucket while the same parameters are staged, its state
    tables pointed at this step's allocations."""
    sub = _kept(bucket, "_staged_launches", tuple(indices),
                lambda: bucket.sub([(i, 0, bucket.rows[i]) for i in indices], None))
    sub.point_states(staged_pointers(entries))
    sub.first = bucket.first
    return sub


def _kept(bucket, name: str, key, build, limit=8):
    """``build()`` kept on ``bucket`` under ``name``/``key`` (at most ``limit`` keys, then
    cleared: a step that stages another set of parameters gets its own entry)."""
    cache = bucket.__dict__.setdefault(name, {})
    value = cache.get(key)
    if value is None:
        if limit is not None and len(cache) >= limit:
            cache.clear()
        value = cache[key] = build()
    return value


def staged_pointers(entries) -> Dict[int, Tuple[list, list]]:
    """Per state: the kernel's pointer lists (main payload, scales or 0) for prefetched entries:
    their slab's address plus the slab layout's offsets of their piece."""
    out: Dict[int, Tuple[list, list]] = {}
    for entry in entries:
        base, j = entry.slab.buffer.data_ptr(), entry.piece
        for k, (mains, scales) in entry.slab.plan.layout.pointer_offsets().items():
            m, s = out.setdefault(k, ([], []))
            m.append(_address(base, mains[j]))
            s.append(_address(base, scales[j]))
    return out


def _address(base: int, where) -> int:
    """An address from :meth:`Layout.pointer_offsets`: offset from ``base``, absolute, or 0."""
    if where is None:
        return 0
    return where[1] if isinstance(where, tuple) else base + where
