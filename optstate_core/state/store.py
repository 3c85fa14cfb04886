"""Where encoded state lives: the ``optimizer.state`` mapping, tiers, and tile-sized moves.

``optimizer.state[p]`` is a plain dict per parameter whose values are what the inner optimizer
made (``step`` counters, scalars), raw tensors (uncompressed, device-resident state), or
:class:`~optstate_core.state.codecs.EncodedTensor` (compressed and/or offloaded state). Nothing else
holds optimizer state, so the mapping is also what checkpoints and frameworks see.
"""
from __future__ import annotations

import math
from typing import Optional, Union

import torch

from .codecs import Codec, EncodedTensor
from .dtensor import local


class ParamState(dict):
    """The state of one parameter: ``{key: tensor | EncodedTensor | number}``."""


class StateMap(dict):
    """``optimizer.state``: parameter -> :class:`ParamState` (created on first access, like torch)."""

    def __missing__(self, param):
        value = self[param] = ParamState()
        return value


def is_scalar_state(value) -> bool:
    """Step counters and other per-parameter scalars: never encoded, never tiled."""
    if isinstance(value, EncodedTensor):
        return False
    if isinstance(value, torch.Tensor):
        return value.dim() == 0 or not (value.is_floating_point() or value.is_complex())
    return True


def keeps_own_shape(value, param) -> bool:
    """A tensor state whose shape is not its parameter's (Adafactor's factored row and column
    statistics, any optimizer's odd-shaped buffer): kept as the inner optimizer made it, beside
    the parameter, in every preset; never encoded, tiled or moved to another tier."""
    return isinstance(value, torch.Tensor) and not is_scalar_state(value) and \
        tuple(value.shape) != tuple(param.shape)


def copy_scalar(value):
    return value.clone() if isinstance(value, torch.Tensor) else value


def matches(current, codec: Codec, host: bool, device: torch.device) -> bool:
    """Whether a stored value already has the target codec and tier."""
    if isinstance(current, EncodedTensor):
        return current.codec == codec and current.host_tier == host and (host or current.device == device)
    if isinstance(current, torch.Tensor):
        return codec.lossless and not host and current.device == device
    return False


def allocate(codec: Codec, shape, dtype: torch.dtype, device: torch.device, host: bool,
             pin_memory: bool) -> Union[torch.Tensor, EncodedTensor]:
    """Empty storage for one state in its target form (raw tensor only for device fp32)."""
    if codec.lossless and not host:
        return torch.empty(shape, dtype=dtype, device=device)
    rows_cols = EncodedTensor(codec, {}, shape, dtype).slab
    where = torch.device("cpu") if host else device
    payload = codec.empty(*rows_cols, where, dtype, pin_memory=(host and pin_memory))
    return EncodedTensor(codec, payload, shape, dtype, host_tier=host)


ALIGN_BYTES = 16  # every view starts 16-byte aligned: the kernels use 128-bit accesses
#: pinned host buffers are carved in slabs of this size: torch's pinned allocator rounds every
#: request up to a power of two (a 17 GiB buffer took 32 GiB), so slabs of exactly 2**28 bytes
#: round nothing and only the last slab of each buffer (under 256 MiB) can be rounded up
PINNED_SLAB_BYTES = 2**28


def pack(sizes, unit: int, slab: Optional[int] = None):
    """``(slab index, offset)`` of each of ``sizes`` elements, every offset a multiple of ``unit``,
    and the element count of each slab: one slab when ``slab`` is None, else slabs of at most
    ``slab`` elements that no view straddles (a view larger than ``slab`` gets a slab of its own)."""
    places, slabs = [], [0]
    for n in sizes:
        padded = -(-n // unit) * unit
        if slab is not None and slabs[-1] and slabs[-1] + padded > slab:
            slabs.append(0)
        places.append((len(slabs) - 1, slabs[-1]))
        slabs[-1] += padded
    return places, [max(s, 1) for s in slabs]


def allocate_many(codec: Codec, shapes, dtype: torch.dtype, device: torch.device, host: bool,
                  pin_memory: bool) -> list:
    """Storage for several states of one codec, carved from one buffer per payload key
    (pinned host memory: from slabs of ``PINNED_SLAB_BYTES``).

    One allocation instead of one per tensor: the CUDA caching allocator rounds large blocks up
    to 2 MiB and pinned host memory to powers of two, which for int8 state costs ~5% (measured).
    Views keep 16-byte alignment; ``torch.save`` stores the shared buffer once.
    """
    where = torch.device("cpu") if host else device
    if codec.lossless and not host:
        layouts = [{"data": ((math.prod(sh),), dtype, 1)} for sh in shapes]
    else:
        layouts = [codec.payload_layout(*EncodedTensor(codec, {}, sh, dtype).slab, dtype) for sh in shapes]
    views = [dict() for _ in shapes]
    pinned = host and pin_memory
    for key in layouts[0] if layouts else ():
        pdtype = layouts[0][key][1]
        itemsize = torch.empty((), dtype=pdtype).element_size()
        unit = max(1, ALIGN_BYTES // itemsize)
        sizes = [math.prod(layout[key][0]) for layout in layouts]
        places, slabs = pack(sizes, unit, PINNED_SLAB_BYTES // itemsize if pinned else None)
        bufs = [torch.empty(n, dtype=pdtype, device=where, pin_memory=pinned) for n in slabs]
        for view, layout, (i, off), n in zip(views, layouts, places, sizes):
            view[key] = bufs[i][off:off + n].view(layout[key][0])
    out = []
    for sh, view in zip(shapes, views):
        if codec.lossless and not host:
            out.append(view["data"].view(sh))
        else:
            out.append(EncodedTensor(codec, view, sh, dtype, host_tier=host))
    return out


def state_nbytes(value) -> int:
    """Bytes this process holds for one state value (a DTensor counts its local shard only)."""
    if isinstance(value, EncodedTensor):
        return value.nbytes
    if isinstance(value, torch.Tensor):
        value = local(value)
        return value.numel() * value.element_size()
    return 0


__all__ = ["ParamState", "StateMap", "is_scalar_state", "keeps_own_shape", "copy_scalar", "matches", "allocate", "allocate_many",
           "state_nbytes"]
