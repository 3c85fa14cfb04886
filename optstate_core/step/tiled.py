"""The tiled reference step: decode a chunk of tiles, run the inner optimizer on views, encode back.

Tiles are flat element ranges that start on a block boundary (a whole parameter when the
optimizer is not elementwise), packed into chunks of bounded bytes, so the full-precision state
materialized at once stays under ``chunk_bytes`` for any tensor size. Every supported update is
elementwise and stochastic rounding is keyed by element index, so results do not depend on the
chunk size.
"""
from __future__ import annotations

import time
from typing import List

import torch

from ..state import master_weights
from ..state.codecs import EncodedTensor
from ..state.codecs.rounding import RoundingContext, state_seed, stream_key
from ..state.dtensor import local
from .inner import run_inner
from ..state.store import copy_scalar, is_scalar_state
from .context import Conformance, StepContext, Transfers
from .work import Tile, Work, describe_param

TILE_GRANULARITY = 256  # every codec's block size divides this


class TiledStep:
    """Steps (or, with ``update=False``, only re-stores) parameters tile by tile, chunk by chunk."""

    def __init__(self, ctx: StepContext, conformance: Conformance, transfers: Transfers):
        self.ctx, self.conformance, self.transfers = ctx, conformance, transfers

    def tiles_of(self, w: Work, max_elems: int) -> List[Tile]:
        p = w.param
        numel, rows, cols = p.numel(), w.rows, w.cols
        tileable = self.ctx.options.granularity == "elementwise" and p.is_contiguous() and all(
            is_scalar_state(v) or (tuple(v.shape) == tuple(p.shape) and
                                   (isinstance(v, EncodedTensor) or v.is_contiguous()))
            for v in w.state.values())
        if not tileable or numel <= max_elems:
            return [Tile(w, 0, numel, 0, rows, 0, cols, whole=True)]
        tiles = []
        if cols <= max_elems:
            per = max(1, max_elems // cols)
            for r in range(0, rows, per):
                r1 = min(rows, r + per)
                tiles.append(Tile(w, r * cols, r1 * cols, r, r1, 0, cols, whole=False))
        else:
            width = max(TILE_GRANULARITY, max_elems // TILE_GRANULARITY * TILE_GRANULARITY)
            for r in range(rows):
                for c in range(0, cols, width):
                    c1 = min(cols, c + width)
                    tiles.append(Tile(w, r * cols + c, r * cols + c1, r, r + 1, c, c1, whole=False))
        return tiles

    def chunks(self, works: List[Work]):
        ctx, options = self.ctx, self.ctx.options
        n_keys = max([sum(1 for v in w.state.values() if not is_scalar_state(v)) for w in works] + [2])
        max_elems = max(TILE_GRANULARITY, options.chunk_bytes // (4 * n_keys))
        max_count = options.chunk_size
        if ctx.step_count == 0 and options.initial_chunk_size:
            first_count = options.initial_chunk_size
        else:
            first_count = max_count
        chunk, used = [], 0
        for w in works:
            tiles = self.tiles_of(w, max_elems)
            w.tiles_left = len(tiles)
            for tile in tiles:
                limit = first_count if not ctx.metrics.chunks else max_count
                if chunk and (used + tile.numel > max_elems or (limit and len(chunk) >= limit)):
                    yield chunk
                    ctx.metrics.chunks += 1
                    chunk, used = [], 0
                chunk.append(tile)
                used += tile.numel
        if chunk:
            ctx.metrics.chunks += 1
            yield chunk

    def run(self, works: List[Work], update: bool) -> None:
        ctx = self.ctx
        self.conformance.preallocate(works)
        for chunk in self.chunks(works):
            t0 = time.perf_counter()
            for tile in chunk:
                self.materialize(tile)
                if update and ctx.policy.master_codec(tile.work.info) is not None:
                    master_weights.open_tile(tile)
            t1 = time.perf_counter()
            if update:
                run_inner(ctx.inner, [(t.tensor, t.states, t.work.info.group_index) for t in chunk])
                for tile in chunk:
                    if tile.master is not None:
                        master_weights.close_tile(tile)
            t2 = time.perf_counter()
            materialized = sum(_materialized_bytes(tile) for tile in chunk)
            metrics = ctx.metrics
            metrics.peak_materialized_bytes = max(metrics.peak_materialized_bytes, materialized)
            for tile in chunk:
                self.commit(tile, update)
            t3 = time.perf_counter()
            metrics.materialize_ms += (t1 - t0) * 1e3
            metrics.inner_step_ms += (t2 - t1) * 1e3
            metrics.commit_ms += (t3 - t2) * 1e3
            metrics.tiles += len(chunk)
        if update:
            for w in works:
                master_weights.forget_seed(w.key)

    def materialize(self, tile: Tile) -> None:
        """Build the tile's parameter/gradient views and its full-precision state."""
        w, p = tile.work, tile.work.param
        if tile.whole:
            tile.tensor = p.detach()
            if w.grad is not None:
                tile.tensor.grad = w.grad
        else:
            tile.tensor = p.detach().view(-1)[tile.start:tile.stop]
            if w.grad is not None:
                tile.tensor.grad = w.grad.reshape(-1)[tile.start:tile.stop]
        states = {}
        for key, value in w.state.items():
            if is_scalar_state(value):
                states[key] = copy_scalar(w.scalars[key])
            elif isinstance(value, EncodedTensor):
                states[key] = self._decode_tile(value, tile, p.device)
            else:
                if value.device != p.device:
                    value = w.state[key] = value.to(p.device)
                value = local(value)
                states[key] = value if tile.whole else value.view(-1)[tile.start:tile.stop]
        tile.states = states

    def _decode_tile(self, enc: EncodedTensor, tile: Tile, device) -> torch.Tensor:
        shape = enc.shape if tile.whole else (tile.numel,)
        out = torch.empty(shape, dtype=enc.dtype, device=device)
        if tile.numel:
            payload = enc.codec.slice_payload(enc.payload, slice(tile.r0, tile.r1), tile.c0, tile.c1, tile.work.cols)
            enc.codec.decode_into(self.transfers.fetch(payload, device), out.view(tile.slab_shape))
        return out

    def commit(self, tile: Tile, update: bool) -> None:
        ctx = self.ctx
        w = tile.work
        step = ctx.step_count
        for key, value in tile.states.items():
            if is_scalar_state(value):
                w.new_scalars.setdefault(key, value)
                continue
            if tuple(value.shape) != (tuple(w.param.shape) if tile.whole else (tile.numel,)):
                if not tile.whole:  # only an optimizer wrongly declared elementwise makes one
                    raise ValueError(f"{type(ctx.inner).__name__} made state {key!r} of shape "
                                     f"{tuple(value.shape)} for a tile of {tile.numel} elements of "
                                     f"{describe_param(w.info)}: it is not elementwise (wrap(..., elementwise=False))")
                w.dest[key] = value  # its own shape (Adafactor's row/column statistics): kept as it is
                continue
            dest = w.dest.get(key)
            if dest is None:
                dest = w.dest[key] = self.conformance.destination(w, key, value)
            if not update and dest is w.state.get(key):
                continue  # re-storing only: a state already in its form keeps its words
            if isinstance(dest, torch.Tensor):
                dest = local(dest)
                target = dest if tile.whole else dest.view(-1)[tile.start:tile.stop]
                if target.data_ptr() != value.data_ptr():
                    target.copy_(value.reshape(target.shape))
            elif tile.numel:
                self._encode_tile(dest, tile, key, value, step)
        tile.states = {}
        tile.tensor = None
        w.tiles_left -= 1
        if w.tiles_left == 0:
            w.state.update(w.new_scalars)
            w.state.update(w.dest)
            ctx.store[w.key] = w.state

    def _encode_tile(self, dest: EncodedTensor, tile: Tile, key: str, value: torch.Tensor, step: int) -> None:
        codec = dest.codec
        view = codec.slice_payload(dest.payload, slice(tile.r0, tile.r1), tile.c0, tile.c1, tile.work.cols)
        rounding = None
        if codec.stochastic_rounding:
            seed = state_seed(self.ctx.options.seed, tile.work.info.index, key)
            rounding = RoundingContext(stream_key(seed, step), tile.work.offset + tile.start, tile.work.cols)
        x = value.reshape(tile.slab_shape)
        if dest.host_tier and x.device.type != "cpu":
            staged = {k: torch.empty_like(v, device=x.device) for k, v in view.items()}
            codec.encode_into(x, staged, rounding)
            self.transfers.put(staged, view)
        else:
            codec.encode_into(x, view, rounding)


def _materialized_bytes(tile: Tile) -> int:
    """Bytes of full-precision state a tile holds beyond the stored state (fresh buffers)."""
    total = 0
    for key, value in tile.states.items():
        if is_scalar_state(value):
            continue
        stored = tile.work.state.get(key)
        if isinstance(stored, torch.Tensor) and \
                value.untyped_storage().data_ptr() == local(stored).untyped_storage().data_ptr():
            continue
        total += value.numel() * value.element_size()
    return total
