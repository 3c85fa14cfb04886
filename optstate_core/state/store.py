"""Where encoded state lives: the ``optimizer.state`` mapping, its tiers, and whole-state moves between them.

``optimizer.state[p]`` is a plain dict per parameter whose values are what the inner optimizer
made (``step`` counters, scalars), raw tensors (uncompressed, device-resident state), or
:class:`~optstate_core.state.codecs.EncodedTensor` (compressed and/or offloaded state). Nothing else
holds optimizer state, so the mapping is also what checkpoints and frameworks see.
"""
from __future__ import annotations

import math
from typing import Optional, Union

import torch

from .codecs import Codec, EncodedTensor, slab_shape
from .pinned import ALIGN_BYTES, PinnedArena
from .dtensor import is_dtensor, like_param, local


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
             pin_memory: bool, arena: Optional[PinnedArena] = None) -> Union[torch.Tensor, EncodedTensor]:
    """Empty storage for one state in its target form (raw tensor only for device fp32)."""
    return allocate_many(codec, [shape], dtype, device, host, pin_memory, arena)[0]


def payload_layout_of(codec: Codec, shape, dtype: torch.dtype) -> dict:
    """The payload layout ``{name: (shape, dtype, column divisor)}`` of a ``shape`` state of ``dtype`` in ``codec``."""
    return codec.payload_layout(*EncodedTensor(codec, {}, shape, dtype).slab, dtype)


def allocate_many(codec: Codec, shapes, dtype: torch.dtype, device: torch.device, host: bool,
                  pin_memory: bool, arena: Optional[PinnedArena] = None) -> list:
    """Storage for several states of one codec, carved from one buffer per payload key; pinned
    host memory comes from ``arena`` (the engine's; a fresh one when None), which by default gives
    each state an allocation of its own (shared pinned buffers break offloaded state on CUDA, see
    :mod:`.pinned`).

    One allocation instead of one per tensor: the CUDA caching allocator rounds large blocks up
    to 2 MiB and pinned host memory to powers of two, which for int8 state costs ~5% (measured).
    Views keep 16-byte alignment; ``torch.save`` stores the shared buffer once.
    """
    where = torch.device("cpu") if host else device
    if codec.lossless and not host:
        layouts = [{"data": ((math.prod(sh),), dtype, 1)} for sh in shapes]
    else:
        layouts = [payload_layout_of(codec, sh, dtype) for sh in shapes]
    views = [dict() for _ in shapes]
    pinned = host and pin_memory
    if pinned and arena is None:
        arena = PinnedArena()
    for key in layouts[0] if layouts else ():
        pdtype = layouts[0][key][1]
        sizes = [math.prod(layout[key][0]) for layout in layouts]
        if pinned:  # each view from the arena (one pinned allocation per view by default)
            for view, layout, n in zip(views, layouts, sizes):
                view[key] = arena.take(n, pdtype, layout[key][0])
            continue
        unit = max(1, ALIGN_BYTES // pdtype.itemsize)
        offsets, total = [], 0
        for n in sizes:
            offsets.append(total)
            total += -(-n // unit) * unit
        buf = torch.empty(max(total, 1), dtype=pdtype, device=where)
        for view, layout, off, n in zip(views, layouts, offsets, sizes):
            view[key] = buf[off:off + n].view(layout[key][0])
    out = []
    for sh, view in zip(shapes, views):
        if codec.lossless and not host:
            out.append(view["data"].view(sh))
        else:
            out.append(EncodedTensor(codec, view, sh, dtype, host_tier=host))
    return out


def payload_views(value) -> dict:
    """The payload of a stored state as ``{name: tensor}``: an :class:`EncodedTensor`'s own, or for
    a raw tensor (the form of uncompressed state on the device, see :func:`allocate_many`) the
    identity codec's ``{"data": [rows, cols] view}`` of its local shard."""
    if isinstance(value, EncodedTensor):
        return value.payload
    t = local(value)
    shape = slab_shape(t.shape)
    return {"data": t.view(shape) if t.is_contiguous() else t.reshape(shape)}


def copy_stored(dst, src, non_blocking: bool = False) -> None:
    """Copy a stored state into storage of the same codec made elsewhere (another tier or device,
    by :func:`allocate_many`). Either side may be an :class:`EncodedTensor` or, for a lossless
    codec on the device, a raw tensor: a parked uncompressed state is an encoded one on the host
    that wakes as a raw tensor, and the other way round. ``non_blocking``: queue CUDA copies (the
    caller waits for them before reading the destination or dropping the source)."""
    out = payload_views(dst)
    for name, t in payload_views(src).items():
        out[name].copy_(t, non_blocking=non_blocking)


def as_stored(param, value):
    """A state that :func:`allocate_many` made for ``param``, in the form the state mapping keeps:
    a raw tensor (a lossless codec on the device) takes the parameter's DTensor form, an
    :class:`EncodedTensor` stays as it is."""
    return like_param(param, value) if isinstance(value, torch.Tensor) and is_dtensor(param) else value


def state_nbytes(value) -> int:
    """Bytes this process holds for one state value (a DTensor counts its local shard only)."""
    if isinstance(value, EncodedTensor):
        return value.nbytes
    if isinstance(value, torch.Tensor):
        value = local(value)
        return value.numel() * value.element_size()
    return 0


__all__ = ["ParamState", "StateMap", "is_scalar_state", "keeps_own_shape", "copy_scalar", "matches", "allocate", "allocate_many", "payload_layout_of",
           "payload_views", "copy_stored", "as_stored", "state_nbytes"]
