"""Moves of encoded payloads between host and device: copy streams, events, a staging ring.

On CUDA, uploads run on one copy stream and write-backs on another, ordered against the
compute stream by events only (no host synchronisation); a staged region is handed out again
only after the copy that last read it has finished. On the CPU the same code runs with plain
copies and no streams, so the ordering logic is exercised by the CPU test suite too.
"""
from __future__ import annotations

import contextlib
from typing import Dict, List, Tuple

import torch

ALIGN = 16


class Transfers:
    """Copies payload tensors between tiers and counts the bytes moved in each direction."""

    def __init__(self):
        self.h2d_bytes = 0
        self.d2h_bytes = 0

    def reset(self) -> None:
        self.h2d_bytes = 0
        self.d2h_bytes = 0

    def fetch(self, payload: Dict[str, torch.Tensor], device: torch.device) -> Dict[str, torch.Tensor]:
        """The payload on ``device`` (views returned unchanged when already there)."""
        out = {}
        for key, t in payload.items():
            if t.device == device:
                out[key] = t
            else:
                out[key] = t.to(device, non_blocking=t.is_pinned())
                if device.type != "cpu":
                    self.h2d_bytes += t.numel() * t.element_size()
        return out

    def put(self, src: Dict[str, torch.Tensor], dst: Dict[str, torch.Tensor]) -> None:
        """Copy ``src`` payload tensors into the (possibly host) ``dst`` views."""
        for key, t in src.items():
            d = dst[key]
            if d.device != t.device and t.device.type != "cpu":
                self.d2h_bytes += t.numel() * t.element_size()
            d.copy_(t)


class Streams:
    """The compute stream plus an upload and a write-back stream (all None on the CPU)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.h2d = torch.cuda.Stream(device)
            self.d2h = torch.cuda.Stream(device)
        else:
            self.h2d = self.d2h = None

    def compute(self):
        return torch.cuda.current_stream(self.device) if self.cuda else None

    def event(self, stream=None):
        """An event recorded now on ``stream`` (None on the CPU, where everything is in order)."""
        if not self.cuda:
            return None
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(stream if stream is not None else self.compute())
        return ev

    def wait(self, stream, event) -> None:
        if self.cuda and event is not None:
            (stream if stream is not None else self.compute()).wait_event(event)

    def on(self, stream):
        return torch.cuda.stream(stream) if self.cuda and stream is not None else contextlib.nullcontext()


class StagingRing:
    """Device memory through which offloaded payloads stream, reused first-in first-out.

    ``reserve`` returns an offset; before the caller's stream may write there it waits on the
    release events of every earlier region that overlaps (GPU-side waits only). A region must be
    released (with the event of the last copy that reads it) before the ring wraps onto it.
    """

    def __init__(self, nbytes: int, device: torch.device, streams: Streams):
        self.size = max(ALIGN, nbytes // ALIGN * ALIGN)
        self.buffer = torch.empty(self.size, dtype=torch.uint8, device=device)
        self.streams = streams
        self.head = 0
        self.live: List[Tuple[int, int, object, bool]] = []  # (start, end, event, released)
        if streams.cuda:  # the buffer was allocated on the compute stream
            streams.h2d.wait_stream(streams.compute())

    def reserve(self, nbytes: int, stream) -> int:
        n = -(-nbytes // ALIGN) * ALIGN
        if n > self.size:
            raise ValueError(f"a staged chunk of {nbytes} bytes exceeds the staging ring ({self.size} bytes)")
        start = self.head if self.head + n <= self.size else 0
        end = start + n
        keep = []
        for region in self.live:
            s, e, event, released = region
            if s < end and start < e:
                if not released:
                    raise RuntimeError("staging ring overrun: a region is reused before its copy was queued")
                self.streams.wait(stream, event)
            else:
                keep.append(region)
        self.live = keep
        self.live.append((start, end, None, False))
        self.head = end
        return start

    def release(self, start: int, event) -> None:
        """Mark the region that starts at ``start`` reusable once ``event`` has completed."""
        for i, (s, e, _, _) in enumerate(self.live):
            if s == start:
                self.live[i] = (s, e, event, True)
                return


def _byte_view(t: torch.Tensor, start: int, nbytes: int) -> torch.Tensor:
    """A flat uint8 view of ``nbytes`` bytes of ``t``'s storage from byte offset ``start``."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage(), start, (nbytes,))


def coalesce_copies(pairs):
    """Merge (host, ring) tensor pairs whose bytes follow each other on both sides (up to the
    16-byte padding both layouts use) into single byte-range pairs."""
    out, run = [], None  # run: [host storage, host start, ring storage, ring start, end offset, first pair]
    for host, ring in pairs:
        if not host.numel():
            continue
        hs = host.storage_offset() * host.element_size()
        rs = ring.storage_offset() * ring.element_size()
        n = host.numel() * host.element_size()
        padded = -(-n // 16) * 16
        if (run is not None and host.untyped_storage().data_ptr() == run[0] and
                ring.untyped_storage().data_ptr() == run[2] and hs - run[1] == rs - run[3] and hs == run[4]
                and host.is_contiguous()):
            run[4] = hs + padded
            run[6] = hs + n
            continue
        if run is not None:
            out.append(run)
        run = [host.untyped_storage().data_ptr(), hs, ring.untyped_storage().data_ptr(), rs, hs + padded,
               (host, ring), hs + n]
    if run is not None:
        out.append(run)
    merged = []
    for hptr, hs, rptr, rs, _, (host, ring), hend in out:
        merged.append((_byte_view(host, hs, hend - hs), _byte_view(ring, rs, hend - hs)))
    return merged
