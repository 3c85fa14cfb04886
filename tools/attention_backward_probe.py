"""Is attention's backward bit-reproducible, alone and beside other GPU work? (docs/benchmarks-journal.md 37)

The 8B offload + release runs of docs/benchmarks-journal.md 36 diverged from one another now and then, first in a
query projection's gradient. This probe repeats one causal attention backward at Llama-3-8B's
shapes (GQA through repeated K/V, as transformers does) with the same inputs and compares every
dQ, dK and dV bit for bit with the first one, per SDPA backend, in three modes:

- ``idle``: nothing else runs on the GPU;
- ``busy``: kernels on a side stream (what the fused step does beside backward under gradient
  release) and a host-to-device copy are queued just before the backward, so they overlap it;
- ``deterministic``: ``busy`` under ``torch.use_deterministic_algorithms(True)``.

``python tools/attention_backward_probe.py --trials 200`` prints one row per backend and mode:
trials, trials whose dQ/dK/dV differ from the first trial's, the largest difference.
"""
import argparse
import json
import logging

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

log = logging.getLogger("attention_backward_probe")
BACKENDS = {"default": None, "flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}
MODES = ("idle", "busy", "deterministic")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=200, help="backward passes per backend and mode")
    p.add_argument("--seq", type=int, default=2048, help="sequence length")
    p.add_argument("--heads", type=int, default=32, help="query heads")
    p.add_argument("--kv-heads", type=int, default=8, help="key/value heads (repeated to --heads)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--backends", default="default,flash,efficient,cudnn,math",
                   help=f"comma-separated, of {', '.join(BACKENDS)} (default: torch's own choice)")
    p.add_argument("--busy-mib", type=int, default=512, help="side-stream work per trial: MiB rewritten")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = p.parse_args(argv)
    for name in a.backends.split(","):
        if name not in BACKENDS:
            p.error(f"--backends: unknown backend {name!r} (choose from {', '.join(BACKENDS)})")
    for flag in ("trials", "seq", "heads", "kv_heads", "head_dim"):
        if getattr(a, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be at least 1")
    if a.busy_mib < 0:
        p.error("--busy-mib must be at least 0")
    if a.heads % a.kv_heads:
        p.error("--heads must be a multiple of --kv-heads")
    return a


def inputs(a, seed=0):
    """Query, key, value and the upstream gradient from one seed (bf16 on a GPU, fp32 on the CPU)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    dtype = torch.bfloat16 if a.device != "cpu" else torch.float32

    def make(heads):
        return torch.randn(1, heads, a.seq, a.head_dim, generator=g).to(a.device, dtype)
    q, k, v = make(a.heads), make(a.kv_heads), make(a.kv_heads)
    return q, k, v, make(a.heads)


def backward(backend, q, k, v, grad):
    """dQ, dK, dV of causal attention with K/V repeated to the query heads."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    chosen = BACKENDS[backend]
    with sdpa_kernel([chosen] if chosen is not None else list(BACKENDS.values())[1:]):
        out = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                             is_causal=True)
    out.backward(grad)
    return q.grad, k.grad, v.grad


class SideWork:
    """Kernels on a side stream and a host-to-device copy, queued so that they overlap the next
    backward (a no-op on the CPU)."""

    def __init__(self, mib, device):
        self.on = device != "cpu" and mib > 0
        if self.on:
            n = mib * 2 ** 20 // 2
            self.stream, self.copy_stream = torch.cuda.Stream(device), torch.cuda.Stream(device)
            self.buf = torch.ones(n, dtype=torch.bfloat16, device=device)
            self.dst = torch.empty(n // 4, dtype=torch.bfloat16, device=device)
            self.host = torch.ones(n // 4, dtype=torch.bfloat16).pin_memory()

    def queue(self):
        if not self.on:
            return
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            for _ in range(8):
                self.buf.mul_(1.0)
        with torch.cuda.stream(self.copy_stream):
            self.dst.copy_(self.host, non_blocking=True)

    def join(self):
        if self.on:
            torch.cuda.current_stream().wait_stream(self.stream)
            torch.cuda.current_stream().wait_stream(self.copy_stream)


def probe(a, backend, mode, side):
    """One row: how many of ``a.trials`` backward passes differ from the first, per gradient."""
    row = {"backend": backend, "mode": mode, "trials": 0, "dq": 0, "dk": 0, "dv": 0, "max_abs": 0.0}
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(mode == "deterministic")
    try:
        q, k, v, grad = inputs(a)
        first = backward(backend, q, k, v, grad)
        for _ in range(a.trials):
            if mode != "idle":
                side.queue()
            got = backward(backend, q, k, v, grad)
            side.join()
            row["trials"] += 1
            for name, x, y in zip(("dq", "dk", "dv"), first, got):
                if not torch.equal(x, y):
                    row[name] += 1
                    row["max_abs"] = max(row["max_abs"], (x.float() - y.float()).abs().max().item())
    except RuntimeError as e:  # a backend that does not take these shapes, or refuses determinism
        row["error"] = str(e).splitlines()[0][:160]
    finally:
        torch.use_deterministic_algorithms(before)
    return row


def main(argv=None):
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    a = parse_args(argv)
    side = SideWork(a.busy_mib, a.device)
    rows = [probe(a, b, m, side) for b in a.backends.split(",") for m in MODES]
    log.info("| backend | mode | trials | dQ differs | dK differs | dV differs | max abs diff |")
    log.info("|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        tail = r.get("error") or f"{r['dq']} | {r['dk']} | {r['dv']} | {r['max_abs']:.3g}"
        log.info(f"| {r['backend']} | {r['mode']} | {r['trials']} | {tail} |")
    for r in rows:
        log.info("PROBE " + json.dumps(r))
    return rows


if __name__ == "__main__":
    main()
