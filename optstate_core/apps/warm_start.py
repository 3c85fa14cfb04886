"""Start cuBLAS and cuDNN's attention on a thread while a model is built, so that its first step does not.

On a machine that has not run CUDA yet, a process's first causal attention forward and backward
took 2.3 s, its first matrix product 0.11 s (0.21 s and 0.11 s in a later process;
``tools/first_use_probe.py``, docs/benchmarks-journal.md 38). :func:`start` runs one small matrix product and
one small causal attention forward and backward on a side stream, on a thread, while the caller
builds its model. It touches no random number generator and none of the caller's tensors: the run
trains bit for bit as without it. Best effort: a failure is logged and changes nothing else.
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Optional

import torch

log = logging.getLogger("optstate.warm_start")


def run_kernels(device: torch.device, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                seq: int = 256) -> None:
    """One small matrix product and one causal attention forward and backward (as a decoder layer's)
    on a side stream of ``device`` (CUDA); waits for them. Constant inputs: no random number generator."""
    stream, on_stream = None, contextlib.nullcontext()
    if device.type == "cuda":
        torch.cuda.set_device(device)
        stream = torch.cuda.Stream(device)
        on_stream = torch.cuda.stream(stream)
    with on_stream:
        hidden = heads * head_dim
        x = torch.full((seq, hidden), 0.01, device=device, dtype=dtype)
        w = torch.full((1024, hidden), 0.01, device=device, dtype=dtype)
        torch.nn.functional.linear(x, w).sum()
        q = torch.full((1, heads, seq, head_dim), 0.01, device=device, dtype=dtype, requires_grad=True)
        k, v = (torch.full((1, kv_heads, seq, head_dim), 0.01, device=device, dtype=dtype, requires_grad=True)
                for _ in range(2))
        gqa = {"enable_gqa": True} if kv_heads != heads else {}
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, **gqa)
        torch.autograd.grad(out.float().sum(), (q, k, v))
    if stream is not None:
        stream.synchronize()


class WarmStart:
    """The warm-start thread: :meth:`join` waits for it; ``seconds`` and ``error`` say what it did."""

    def __init__(self, device: torch.device, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype):
        self.seconds: Optional[float] = None
        self.error: Optional[str] = None
        self._thread = threading.Thread(target=self._run, args=(device, heads, kv_heads, head_dim, dtype),
                                        name="optstate-warm-start", daemon=True)
        self._thread.start()

    def _run(self, device, heads, kv_heads, head_dim, dtype) -> None:
        t0 = time.perf_counter()
        try:
            run_kernels(device, heads, kv_heads, head_dim, dtype)
        except Exception as exc:  # noqa: BLE001 - best effort: the first step does this work then
            self.error = f"{type(exc).__name__}: {exc}"
            log.warning("warm start failed (%s); the first step loads CUDA's libraries itself", self.error)
        finally:
            self.seconds = time.perf_counter() - t0

    def join(self, timeout: Optional[float] = None) -> "WarmStart":
        self._thread.join(timeout)
        return self

    def summary(self) -> dict:
        """What the thread did, for a result row (``seconds`` None while it runs)."""
        return {"seconds": self.seconds, "error": self.error}


def start(device, heads: int, kv_heads: Optional[int] = None, head_dim: int = 128,
          dtype: torch.dtype = torch.bfloat16) -> Optional[WarmStart]:
    """Start warming cuBLAS and attention for a model with these attention shapes on ``device``; None
    where there is nothing to warm (not a CUDA device)."""
    device = torch.device(device)
    kv_heads = heads if kv_heads is None else kv_heads
    for name, value in (("heads", heads), ("kv_heads", kv_heads), ("head_dim", head_dim)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads})")
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return WarmStart(device, heads, kv_heads, head_dim, dtype)
