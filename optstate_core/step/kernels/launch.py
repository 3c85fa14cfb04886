"""Launch helpers: pointer tables and per-program work lists for the multi-tensor kernels.

A launch covers T tensors. Each tensor is seen as a ``[rows, cols]`` slab cut into 256-column
tiles (row-major); tensor ``t`` gets programs ``PROG_START[t] .. PROG_START[t + 1] - 1``, each
updating ``NBLK`` consecutive tiles (the kernels find ``t`` by binary search). Tables live on the device; pointer tables are rebuilt each step
(gradients and payloads may move) through pinned memory without a host synchronisation, the
shape tables are cached by shapes.

Every cache here is kept per CUDA stream (:func:`stream_key`): launches run on the stream that is
current (under FSDP2 gradient release updates on FSDP's post-reduce stream, ``step()`` on the
default stream), and a table is only read on the stream it was allocated on. The caching
allocator hands a freed block again only to its own stream, so a table dropped from a cache can
never be overwritten while a launch queued on another stream still reads it. The one exception
is CUDA-graph capture (on a stream of its own, after a warm-up on another): it reuses the tables
the warm-up built, as a graph must (no copy is captured); a graph's tables live as long as it is
replayed in steady state, as before.
"""
from __future__ import annotations

import math
from typing import Dict, List, Sequence, Tuple

import torch

TILE = 256
MAX_TENSORS = 4096  # per launch (the kernels scan the per-tensor table in one vector)
_SHAPE_CACHE: Dict[tuple, Dict[int, tuple]] = {}  # (shapes, nblk, device) -> {stream key: tables}
_TABLE_CACHE: Dict[tuple, Dict[int, torch.Tensor]] = {}  # (values, device) -> {stream key: table}
# pointer tables kept (a few small device tensors each): gradient release launches once per
# parameter, ~10 tables each, so a large model needs thousands to stay cached from step to step
MAX_CACHED_TABLES = 16384


def stream_key(device: torch.device) -> int:
    """The current stream of ``device`` as a cache key (its raw handle; 0 off CUDA)."""
    if device.type != "cuda":
        return 0
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch._C._cuda_getCurrentRawStream(index)


def _cached(cache: dict, key: tuple, device: torch.device, build, limit: int):
    """``cache[key]`` for the current stream of ``device``, built on a miss (the cache is
    cleared first when it holds more than ``limit`` keys); during CUDA-graph capture any stream's."""
    entry = cache.get(key)
    stream = stream_key(device)
    if entry is not None:
        hit = entry.get(stream)
        if hit is not None:
            return hit
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return next(iter(entry.values()))
    elif len(cache) > limit:
        cache.clear()
    value = build()
    cache.setdefault(key, {})[stream] = value
    return value


def slab(shape) -> Tuple[int, int]:
    numel = math.prod(shape)
    rows = shape[0] if len(shape) >= 2 else 1
    return rows, (numel // rows if rows else 0)


def device_table(values: Sequence[int], device: torch.device, dtype=torch.int64) -> torch.Tensor:
    """A small integer table on ``device`` (async copy from pinned memory on CUDA)."""
    cuda = device.type == "cuda"
    return torch.tensor(list(values), dtype=dtype, pin_memory=cuda).to(device, non_blocking=cuda)


def work_tables(shapes: List[tuple], nblk: int, device: torch.device):
    """(COLS, NBR, NBLOCKS, PROG_START, n_tensors, TPOW2, n_programs) for tensors of these shapes."""
    return _cached(_SHAPE_CACHE, (tuple(shapes), nblk, str(device)), device,
                   lambda: _work_tables(shapes, nblk, device), limit=256)


def _work_tables(shapes: List[tuple], nblk: int, device: torch.device):
    cols, nbr, nblocks, prog_start = [], [], [], [0]
    for shape in shapes:
        rows, c = slab(shape)
        per_row = -(-c // TILE)
        total = rows * per_row
        cols.append(c)
        nbr.append(max(per_row, 1))
        nblocks.append(total)
        prog_start.append(prog_start[-1] + -(-total // nblk))
    if len(shapes) >= MAX_TENSORS:
        raise ValueError(f"at most {MAX_TENSORS - 1} tensors per launch")
    tpow2 = max(16, 1 << len(shapes).bit_length())
    return (device_table(cols, device), device_table(nbr, device), device_table(nblocks, device),
            device_table(prog_start, device, torch.int32), len(shapes), tpow2, prog_start[-1])


def pointer_table(tensors: Sequence, device: torch.device) -> torch.Tensor:
    """Addresses of tensors (None -> 0) as an int64 device table, reused while the addresses stay
    the same (no copy at all in steady state, which also keeps a captured CUDA graph valid)."""
    return cached_table([t.data_ptr() if t is not None else 0 for t in tensors], device)


def cached_table(values: Sequence[int], device: torch.device) -> torch.Tensor:
    values = tuple(values)
    return _cached(_TABLE_CACHE, (values, str(device)), device, lambda: device_table(values, device),
                   limit=MAX_CACHED_TABLES)


#: sub-tables of :func:`cached_tables` start at multiples of this many entries (16 bytes: the
#: alignment Triton specializes pointer arguments on, so a view launches the same compiled kernel)
TABLE_ALIGN = 2


def cached_tables(lists: Sequence[Sequence[int]], device: torch.device) -> List[torch.Tensor]:
    """Several int64 tables as views of one cached device table: tables that change together
    (a launch's gradient addresses and clip factors, a staged slab's state addresses) cost one
    host-to-device copy per change instead of one each."""
    flat, starts = [], []
    for values in lists:
        starts.append(len(flat))
        flat.extend(values)
        flat.extend([0] * (-len(flat) % TABLE_ALIGN))
    table = cached_table(flat, device)
    return [table[s:s + len(values)] for s, values in zip(starts, lists)]


def clear_caches() -> None:
    """Drop cached device tables (rebuilt on demand; used when an optimizer closes)."""
    _SHAPE_CACHE.clear()
    _TABLE_CACHE.clear()
