"""The Codec protocol and the encoded form of one state tensor.

Layout shared by every codec (and by the Triton kernels): a state of shape ``S`` is seen as a
2-D slab ``[rows, cols]`` with ``rows = S[0]`` (1 for a 1-D state) and ``cols = numel // rows``.
Blocks run along ``cols`` inside one row, so a row range (what FSDP2's ``Shard(0)`` hands a
rank) always holds whole blocks, and the layout depends only on the global shape.

A codec's payload is a dict of 2-D tensors whose column ``j`` covers element columns
``[j * div, (j + 1) * div)`` for that tensor's column divisor ``div`` (1 for one value per
element, 2 for packed nibbles, the block size for per-block scales). Any tile whose column
range starts on a multiple of :attr:`Codec.granularity` can therefore be encoded or decoded
through views, without touching the rest of the tensor.
"""
from __future__ import annotations

import math
from typing import Dict, Optional, Tuple

import torch

from .kinds import StateKind
from .rounding import RoundingContext

Payload = Dict[str, torch.Tensor]


def slab_shape(shape: torch.Size | Tuple[int, ...]) -> Tuple[int, int]:
    """The ``[rows, cols]`` view of a state of this (global) shape."""
    numel = math.prod(shape)
    rows = shape[0] if len(shape) >= 2 else 1
    return rows, (numel // rows if rows else 0)


class Codec:
    """Encode/decode 2-D float slabs into a payload of smaller tensors.

    Subclasses set :attr:`name`, :attr:`granularity` and implement the four methods below.
    Codecs know nothing about parameters, tiers or optimizers.
    """

    name: str = "codec"
    granularity: int = 1  # tile column starts must be multiples of this
    lossless: bool = False
    stochastic_rounding: bool = False
    #: how the fused kernels hold this state (None: they cannot; the state goes the reference path)
    kernel_form: Optional[StateKind] = None

    # -- what subclasses implement -------------------------------------------------------
    def payload_layout(self, rows: int, cols: int, dtype: torch.dtype = torch.float32
                       ) -> Dict[str, Tuple[Tuple[int, int], torch.dtype, int]]:
        """``{name: ((rows, payload_cols), dtype, column divisor)}`` for a slab of a state of ``dtype``."""
        raise NotImplementedError

    def encode_into(self, x: torch.Tensor, out: Payload, rounding: Optional[RoundingContext]) -> None:
        """Encode the float slab ``x`` (2-D) into the payload views ``out``."""
        raise NotImplementedError

    def decode_into(self, payload: Payload, out: torch.Tensor) -> torch.Tensor:
        """Decode payload views into the 2-D slab ``out`` (any float dtype) and return it."""
        raise NotImplementedError

    # -- the fused kernels' view (``kernel_form``) -------------------------------------------
    def kernel_constants(self) -> Tuple[int, float, int]:
        """The kernels' (levels, 1 / power, integer power) of this codec (a 4-bit codebook's;
        others take the defaults ``(2, 0.5, 0)``, which the kernels do not read)."""
        return 2, 0.5, 0

    def kernel_tables(self, device) -> Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """(levels, midpoints, decode table) the kernels read on ``device``; None: no tables."""
        return None

    # -- shared machinery ------------------------------------------------------------------
    def specialize(self, nonnegative: bool) -> "Codec":
        """The variant of this codec for a signed (momentum) or non-negative (variance) state."""
        return self

    def config(self) -> dict:
        """Primitive description, enough for :func:`optstate_core.state.codecs.codec_from_config`."""
        return {"name": self.name}

    def empty(self, rows: int, cols: int, device, dtype: torch.dtype = torch.float32,
              pin_memory: bool = False) -> Payload:
        out = {}
        for key, (shape, pdtype, _) in self.payload_layout(rows, cols, dtype).items():
            t = torch.empty(shape, dtype=pdtype, device=device)
            out[key] = t.pin_memory() if pin_memory and t.device.type == "cpu" else t
        return out

    def nbytes(self, rows: int, cols: int, dtype: torch.dtype = torch.float32) -> int:
        total = 0
        for shape, dtype, _ in self.payload_layout(rows, cols, dtype).values():
            total += math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        return total

    def slice_payload(self, payload: Payload, rows: slice, c0: int, c1: int, cols_total: int) -> Payload:
        """Views of the payload for element rows ``rows`` and element columns ``[c0, c1)``."""
        layout = self.payload_layout(1, cols_total)
        out = {}
        for key, t in payload.items():
            div = layout[key][2]
            out[key] = t[rows, c0 // div: -(-c1 // div)]
        return out

    def encode(self, x: torch.Tensor, rounding: Optional[RoundingContext] = None,
               pin_memory: bool = False, device=None) -> "EncodedTensor":
        """Encode a whole state tensor (any shape) into a new :class:`EncodedTensor`."""
        rows, cols = slab_shape(x.shape)
        payload = self.empty(rows, cols, device or x.device, x.dtype, pin_memory=pin_memory)
        if x.numel():
            self.encode_into(x.reshape(rows, cols), payload, rounding)
        return EncodedTensor(self, payload, x.shape, x.dtype)

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.config().items() if k != "name")
        return f"{type(self).__name__}({args})"

    def __eq__(self, other) -> bool:
        return isinstance(other, Codec) and self.config() == other.config()

    def __hash__(self) -> int:
        return hash(tuple(sorted(self.config().items())))


class EncodedTensor:
    """One optimizer-state tensor held in a codec's payload.

    It is what ``optimizer.state[p][key]`` holds for a compressed (or offloaded) state.
    :meth:`decode` gives the full-precision tensor back. ``to(device)`` moves the payload,
    except that a host-tier (offloaded) payload ignores moves to an accelerator: frameworks
    that move every optimizer-state value to the GPU at setup must not pull offloaded state
    back (the engine fetches it chunk by chunk during ``step()``).
    """

    __slots__ = ("codec", "payload", "shape", "dtype", "host_tier")

    def __init__(self, codec: Codec, payload: Payload, shape, dtype: torch.dtype, host_tier: bool = False):
        self.codec = codec
        self.payload = payload
        self.shape = torch.Size(shape)
        self.dtype = dtype
        self.host_tier = host_tier

    @property
    def device(self) -> torch.device:
        return next(iter(self.payload.values())).device

    @property
    def slab(self) -> Tuple[int, int]:
        return slab_shape(self.shape)

    def numel(self) -> int:
        return math.prod(self.shape)

    def payload_contiguous(self) -> bool:
        return all(t.is_contiguous() for t in self.payload.values())

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.payload.values())

    def decode(self, device=None, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """The full-precision tensor (a new tensor; the payload is not changed)."""
        device = torch.device(device) if device is not None else self.device
        out = torch.empty(self.shape, dtype=dtype or self.dtype, device=device)
        if out.numel():
            payload = {k: v.to(device, non_blocking=True) for k, v in self.payload.items()}
            self.codec.decode_into(payload, out.view(self.slab))
        return out

    def to(self, *args, **kwargs) -> "EncodedTensor":
        device, dtype, non_blocking, _ = torch._C._nn._parse_to(*args, **kwargs)
        if device is None or torch.device(device) == self.device:
            return self
        if self.host_tier and torch.device(device).type != "cpu":
            return self
        payload = {k: v.to(device, non_blocking=non_blocking) for k, v in self.payload.items()}
        return EncodedTensor(self.codec, payload, self.shape, self.dtype, self.host_tier)

    def clone(self) -> "EncodedTensor":
        return EncodedTensor(self.codec, {k: v.clone() for k, v in self.payload.items()},
                             self.shape, self.dtype, self.host_tier)

    def __deepcopy__(self, memo):
        return self.clone()

    def __repr__(self) -> str:
        return (f"EncodedTensor(codec={self.codec!r}, shape={tuple(self.shape)}, dtype={self.dtype}, "
                f"device={self.device}, nbytes={self.nbytes}{', host tier' if self.host_tier else ''})")
