"""Measurement helpers shared by the benchmarks: state bytes held, bandwidth, device sync."""
from __future__ import annotations

import time

import torch


def state_bytes(opt) -> int:
    """GPU bytes an optimizer holds between steps (memory_report() for optstate)."""
    if hasattr(opt, "memory_report"):
        return opt.memory_report()["device_bytes"]
    total = 0
    for st in opt.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                total += _tensor_bytes(v)
    return total


def _tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of a state tensor on this rank (a DTensor's local shard, a subclass's inner tensors)."""
    if hasattr(t, "_local_tensor"):
        t = t._local_tensor
    inner = getattr(t, "__tensor_flatten__", None)
    if inner is not None:  # tensor subclasses (torchao): count their inner tensors
        names, _ = t.__tensor_flatten__()
        return sum(_tensor_bytes(getattr(t, n)) for n in names)
    return t.numel() * t.element_size()


def sync(device) -> None:
    """Wait until the device is idle (no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def pinned_bandwidth(device, nbytes: int = 2**28) -> float:
    """Measured pinned host<->device bandwidth (bytes/s, mean of both directions)."""
    if device.type != "cuda":
        return float("nan")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    times = []
    for src, dst in ((host, dev), (dev, host)):
        dst.copy_(src, non_blocking=True)
        sync(device)
        t = time.perf_counter()
        for _ in range(5):
            dst.copy_(src, non_blocking=True)
        sync(device)
        times.append((time.perf_counter() - t) / 5)
    return nbytes / (sum(times) / 2)


def duplex_bandwidth(device, nbytes: int = 2**28) -> float:
    """Measured pinned bandwidth per direction while both directions copy at once (bytes/s; two
    copy streams), the rate an offloaded step's uploads get while write-backs come down."""
    if device.type != "cuda":
        return float("nan")
    hosts = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
    devs = [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(2)]
    streams = [torch.cuda.Stream(device), torch.cuda.Stream(device)]

    def both():
        with torch.cuda.stream(streams[0]):
            devs[0].copy_(hosts[0], non_blocking=True)
        with torch.cuda.stream(streams[1]):
            hosts[1].copy_(devs[1], non_blocking=True)
    both()
    sync(device)
    t = time.perf_counter()
    for _ in range(5):
        both()
    sync(device)
    return nbytes / ((time.perf_counter() - t) / 5)


def device_name(device) -> str:
    """The GPU's name, or "cpu"."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu"
