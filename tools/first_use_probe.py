"""How long does each first use of CUDA take in a fresh process, and how much of it can a warm start take off?

A process's first training step on a machine that has not run CUDA yet took 7.3-7.8 s for the 8B
recipe, later processes 3.7 s with Triton's cache just as empty (docs/benchmarks-journal.md sections 34 and
38). This probe times, in order and in one process, each first use a step makes, then each one
again (the warm cost):

- ``import_torch``, ``cuda_init`` (the context and a first allocation);
- ``matmul``: a bf16 ``linear`` at a decoder layer's shape (cuBLAS / cuBLASLt);
- ``attention``: a causal attention forward and backward at Llama-3-8B's shapes (torch's default
  SDPA backend: cuDNN's libraries load here);
- ``triton_compile``: one of optstate's own kernels compiled, not launched (Triton's start-up and
  its compile); ``triton_launch``: its first launch (the module's load and, in Triton 3.6, the
  launcher's build: a C module compiled with gcc).

``--warm-start`` first runs ``optstate_core.apps.warm_start`` (what examples/finetune_8b_24gb.py
does while it builds the model) and waits for it, timing it apart. Set ``TRITON_CACHE_DIR`` to a new
directory to time Triton's compile as on a fresh machine. One JSON line per run to stdout and to
``--json PATH``::

    TRITON_CACHE_DIR=$(mktemp -d) python tools/first_use_probe.py [--warm-start] [--json rows.jsonl]
"""
import time

T0 = time.perf_counter()
import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=2048, help="attention's sequence length")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--warm-start", action="store_true", help="run optstate's warm start first and wait for it")
    p.add_argument("--json", default=None, help="append the row to this file")
    args = p.parse_args(argv)
    for name in ("seq", "heads", "kv_heads", "head_dim"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.heads % args.kv_heads:
        p.error(f"--heads ({args.heads}) must be a multiple of --kv-heads ({args.kv_heads})")
    return args


def timed(fn, sync) -> float:
    """Seconds ``fn`` takes until the device is idle."""
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def main(argv=None) -> dict:
    args = parse_args(argv)
    t = time.perf_counter()
    import torch
    row = {"import_torch": time.perf_counter() - t, "warm_start": None}
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    row["cuda_init"] = timed(lambda: torch.zeros(1, device=dev), sync) if cuda else 0.0
    if args.warm_start:
        from optstate_core.apps import warm_start
        t = time.perf_counter()
        warm = warm_start.start(dev, args.heads, args.kv_heads, args.head_dim)
        row["warm_start"] = dict(warm.join().summary(), wall=time.perf_counter() - t) if warm else None

    hidden = args.heads * args.head_dim
    x = torch.randn(args.seq, hidden, device=dev, dtype=dtype)
    w = torch.randn(hidden, hidden, device=dev, dtype=dtype)
    q = torch.randn(1, args.heads, args.seq, args.head_dim, device=dev, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(1, args.kv_heads, args.seq, args.head_dim, device=dev, dtype=dtype, requires_grad=True)
            for _ in range(2))
    rep = args.heads // args.kv_heads

    def attention():
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), is_causal=True)
        torch.autograd.grad(out.float().sum(), (q, k, v))

    from optstate_core.step.kernels import interpreting
    from optstate_core.step.kernels.adam import advance_steps_kernel
    step = torch.zeros(1, dtype=torch.float32, device=dev)  # a step count, through a pointer table
    table = torch.tensor([step.data_ptr()], dtype=torch.int64, device=dev)
    triton_runs = cuda and not interpreting()  # (on the CPU only interpreted: nothing to compile)

    def triton_compile():  # Triton's start-up and the compile, nothing launched
        if triton_runs:
            advance_steps_kernel.warmup(table, grid=(1,))

    def triton_launch():  # the first launch: the module loaded, the launcher built (a gcc compile in 3.6)
        if triton_runs:
            advance_steps_kernel[(1,)](table)

    uses = {"matmul": lambda: torch.nn.functional.linear(x, w), "attention": attention,
            "triton_compile": triton_compile, "triton_launch": triton_launch}
    for name, fn in uses.items():
        row[name] = timed(fn, sync)
    for name, fn in uses.items():
        row[name + "_again"] = timed(fn, sync)
    row["process_s"] = time.perf_counter() - T0
    row["device"] = torch.cuda.get_device_name(dev) if cuda else "cpu"
    line = json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()})
    print(line)
    if args.json:
        with open(args.json, "a") as f:
            f.write(line + "\n")
    return row


if __name__ == "__main__":
    main()
