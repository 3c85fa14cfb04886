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
    """Measured pinned host<->device bandwidth (bytes/s, over the mean time of the two directions)."""
    return copy_bandwidths(device, nbytes)["mean"]


def copy_bandwidths(device, nbytes: int = 2**28) -> dict:
    """Measured pinned host<->device bandwidths (bytes/s): each direction alone (``h2d``, ``d2h``),
    ``mean`` (``nbytes`` over the mean of their copy times) and ``duplex``, per direction while
    both copy at once on two copy streams (the rate an offloaded step's uploads get while
    write-backs come down). NaN off CUDA."""
    if device.type != "cuda":
        return dict.fromkeys(("h2d", "d2h", "mean", "duplex"), float("nan"))
    hosts = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
    devs = [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(2)]
    up, down = torch.cuda.Stream(device), torch.cuda.Stream(device)

    def h2d():
        with torch.cuda.stream(up):
            devs[0].copy_(hosts[0], non_blocking=True)

    def d2h():
        with torch.cuda.stream(down):
            hosts[1].copy_(devs[1], non_blocking=True)

    def both():
        h2d()
        d2h()
    t_up, t_down, t_both = (_seconds_per_call(fn, device) for fn in (h2d, d2h, both))
    return {"h2d": nbytes / t_up, "d2h": nbytes / t_down, "mean": nbytes / ((t_up + t_down) / 2),
            "duplex": nbytes / t_both}


def _seconds_per_call(fn, device, reps: int = 5) -> float:
    """Wall seconds per call of ``fn`` until the device is idle, after one warm-up call."""
    fn()
    sync(device)
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    sync(device)
    return (time.perf_counter() - t) / reps


def device_name(device) -> str:
    """The GPU's name, or "cpu"."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu"
