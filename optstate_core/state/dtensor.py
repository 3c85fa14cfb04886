"""DTensor (FSDP2 / tensor-parallel) helpers: optimizer math runs on local shards, decisions
use global shapes, and checkpoints carry encoded shards as DTensors with the parameter's mesh.

Blocks run along the rows of the ``[rows, cols]`` slab of the *global* shape, so a row shard
(``Shard(0)`` of a tensor with 2+ dims, what FSDP2 uses) holds whole blocks and encodes
exactly the rows of the unsharded encoding; DCP can then reshard the encoded state like any
row-sharded tensor. A 1-D tensor sharded on dim 0 splits its single slab row: it keeps block
alignment only when the shard size is a multiple of the codec's granularity (256 for the block
codecs; any size for the per-element ones: bf16, fp24, master corrections), decided from the global
shape and the codec, so every rank agrees; other layouts keep their state uncompressed.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

try:  # torch >= 2.4
    from torch.distributed.tensor import DTensor, Replicate, Shard
except Exception:  # pragma: no cover - very old torch
    DTensor = None


def is_dtensor(t) -> bool:
    return DTensor is not None and isinstance(t, DTensor)


def local(t):
    """The local shard of a DTensor (the tensor itself otherwise); None stays None."""
    return t._local_tensor if is_dtensor(t) else t


def slab_placements(param, granularity: int = 256) -> Optional[list]:
    """Placements of the payload slab ``[rows, cols]`` of a DTensor parameter, or None when the
    layout cannot keep whole blocks of ``granularity`` elements (a codec's) on every rank (then
    the state stays uncompressed)."""
    placements = []
    for pl in param.placements:
        if isinstance(pl, Replicate):
            placements.append(Replicate())
        elif isinstance(pl, Shard) and pl.dim == 0:
            if param.dim() >= 2:
                placements.append(Shard(0))
            else:  # a 1-D tensor: shards split columns of its single slab row
                world = param.device_mesh.size(len(placements))
                chunk = -(-param.shape[0] // world)
                if chunk % granularity:
                    return None
                placements.append(Shard(1))
        else:
            return None
    return placements


def as_dtensor(param, local_tensor: torch.Tensor, global_shape, placements) -> "DTensor":
    """A local payload (or state) tensor as a DTensor on the parameter's mesh."""
    stride = tuple(math.prod(global_shape[i + 1:]) for i in range(len(global_shape)))
    return DTensor.from_local(local_tensor, param.device_mesh, placements, run_check=False,
                              shape=torch.Size(global_shape), stride=stride)


def like_param(param, local_tensor: torch.Tensor) -> "DTensor":
    """A full-shape state tensor of a DTensor parameter, from its local shard."""
    return DTensor.from_local(local_tensor.view(param._local_tensor.shape), param.device_mesh, param.placements,
                              run_check=False, shape=param.shape, stride=param.stride())


def global_flat_offset(param) -> int:
    """Index, in the global tensor, of the local shard's first element (0 for plain tensors), so
    stochastic rounding draws the same counters however the tensor is sharded."""
    if not is_dtensor(param):
        return 0
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    strides = [math.prod(param.shape[i + 1:]) for i in range(len(param.shape))]
    return sum(o * s for o, s in zip(offset, strides))


def any_distributed(params) -> bool:
    """Whether some parameters are DTensors in an initialized process group."""
    return any(is_dtensor(p) for p in params) and torch.distributed.is_available() \
        and torch.distributed.is_initialized()


def agree_on_flags(flags: torch.Tensor) -> torch.Tensor:
    """Every rank skips a parameter if any rank found a NaN/inf in its shard of the gradient."""
    torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
    return flags


def payload_to_dtensor(param, enc, global_slab) -> dict:
    """An encoded state's local payload as DTensors with the global payload shapes."""
    placements = slab_placements(param, enc.codec.granularity)
    layout = enc.codec.payload_layout(*global_slab, enc.dtype)
    return {name: as_dtensor(param, t, layout[name][0], placements) for name, t in enc.payload.items()}


def local_rows_of(param, full: torch.Tensor, divisor: int) -> torch.Tensor:
    """The rank's part of a full-size payload tensor of a DTensor parameter (no communication)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    if param.dim() >= 2:
        return full[offset[0]:offset[0] + shape[0]]
    c0 = offset[0] // divisor
    return full[:, c0:c0 + -(-shape[0] // divisor)]
