"""How the CPU fast path (``cpu_step.py``) is compiled: inductor with ``bucketize`` decomposed
into comparisons, sizes traced symbolically, and one log line per compiled combination."""
from __future__ import annotations

import logging
from typing import Dict

import torch

log = logging.getLogger("optstate")


def bucketize_by_counting(input, boundaries, *, out_int32=False, right=False):
    """``aten.bucketize`` for sorted ``boundaries`` as a count of comparisons (inductor's C++
    backend has no bucketize and would call the eager kernel between its fused loops): the
    index is the number of boundaries below the value (at or below it with ``right``), NaN last.
    A short table (a codebook) is unrolled into elementwise compares, which vectorize."""
    n = int(boundaries.shape[0])  # specializes the table's length: one guard
    if n <= UNROLL_BOUNDARIES:
        count = torch.zeros_like(input, dtype=torch.int32)  # int32 vectors hold twice the lanes
        for i in range(n):
            count = count + ((boundaries[i] <= input) if right else (boundaries[i] < input)).to(torch.int32)
    else:
        count = ((boundaries <= input.unsqueeze(-1)) if right else (boundaries < input.unsqueeze(-1))).sum(-1)
    index = torch.where(input != input, n, count)  # NaN (a comparison vectorizes where isnan does not)
    return index.to(torch.int32 if out_int32 else torch.int64)


UNROLL_BOUNDARIES = 64


#: codes index lookup tables that always hold 2**bits entries: no per-element bounds check
INDUCTOR_PATCHES = {"assert_indirect_indexing": False}


def inductor_backend(gm, example_inputs):
    """inductor, with bucketize decomposed into comparisons (so the 4-bit encode fuses too)."""
    from torch._inductor.compile_fx import compile_fx
    from torch._inductor.decomposition import select_decomp_table
    table = dict(select_decomp_table())
    table[torch.ops.aten.bucketize.Tensor] = bucketize_by_counting
    return compile_fx(gm, example_inputs, decompositions=table, config_patches=INDUCTOR_PATCHES)


def mark_sizes(args, widths_too: bool):
    """Mark the row count (and with ``widths_too`` the width) of every 2-D argument symbolic
    for the compiler: one graph for any number of rows (and any width)."""
    ps, gs, m_payloads, v_payloads = args[:4]
    tensors = [*ps, *gs, *(t for d in m_payloads for t in d.values()), *(t for d in v_payloads for t in d.values())]
    for t in tensors:
        for dim in ((0, 1) if widths_too else (0,)):
            torch._dynamo.maybe_mark_dynamic(t, dim)
    return args


def shape_config():
    """Trace sizes symbolically, 1 included, and never equate unrelated sizes (a lookup table's
    length with a row count): a handful of graphs per codec pair instead of one per shape."""
    return torch.fx.experimental._config.patch(backed_size_oblivious=True, use_duck_shape=False)


_COMPILE_SECONDS: Dict[tuple, float] = {}


def note_compile(flags, batch: int, seconds: float) -> None:
    """Log the first (compiling) call of each combination and batch size."""
    if (flags, batch) not in _COMPILE_SECONDS:
        _COMPILE_SECONDS[flags, batch] = seconds
        width = "any width" if flags[-1] is None else f"rows of {flags[-1]}"
        log.info("optstate: CPU fast path compiled for %s/%s, %s, %d slice(s) a call, in %.1f s",
                 flags[0].name, flags[1].name, width, batch, seconds)
