"""Host cost of gradient release: Python and dispatch time per released parameter, without the GPU.

    python tools/release_host_cost.py [--preset bf16w-4bit-lean] [--layers 16] [--steps 20] [--profile 25] \
        [--max-grad-norm 1.0 --batches 8]
    python tools/release_host_cost.py --device cuda      # on a GPU: the same loop with the real kernels

With release, every parameter is updated from its own post-accumulate-grad hook: one plan, one
bucket, a few small launches each. On an H100 the kernels are short and this host work is what
the step costs (README: Gradient release). This script runs the release path on tiny Llama-like
shapes (the parameter count of the 0.95B model: 16 layers of 9 tensors, embedding, final norm,
lm_head) on the fused path, on the CPU with the Triton kernels replaced by no-ops (so only the
host work is timed: Python, torch dispatch, table building), and prints the median host ms per
step (all hooks + ``step()`` + ``zero_grad()``) and per parameter; ``--profile N`` adds cProfile's
top N functions by own time.
"""
import argparse
import cProfile
import os
import pstats
import statistics
import sys
import time

os.environ.setdefault("TRITON_INTERPRET", "1")  # the fused path on the CPU (kernels stubbed below)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

import optstate_core as oc  # noqa: E402


class _NoKernel:
    """Stands in for a Triton kernel: ``kernel[grid](...)`` does nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def stub_kernels() -> None:
    from optstate_core.step.kernels import adam
    for name in ("adam_kernel", "bias_corrections_kernel", "advance_steps_kernel"):
        setattr(adam, name, _NoKernel())


def shapes(layers: int, hidden: int, ffn: int, vocab: int):
    out = [(vocab, hidden)]
    for _ in range(layers):
        out += [(hidden, hidden)] * 4 + [(ffn, hidden)] * 2 + [(hidden, ffn), (hidden,), (hidden,)]
    return out + [(hidden,), (vocab, hidden)]


def run(args) -> dict:
    device = torch.device(args.device)
    if device.type == "cpu":
        stub_kernels()
    params = [torch.nn.Parameter((torch.randn(s) * 0.02).to(device, torch.bfloat16))
              for s in shapes(args.layers, args.hidden, args.ffn, args.vocab)]
    grad_bytes = sum(p.numel() * p.element_size() for p in params)
    bucket = {} if args.batches is None else {"release_bucket_bytes": -(-grad_bytes // args.batches)}
    opt = oc.wrap(torch.optim.AdamW(params, lr=1e-4), args.preset, fused=True, release_gradients=True,
                  max_grad_norm=args.max_grad_norm, **bucket)
    schedule = opt._engine.schedule
    grads = [torch.randn(p.shape, device=device).to(torch.bfloat16) for p in params]

    def one_step():
        for p, g in zip(reversed(params), reversed(grads)):  # backward order
            p.grad = g.clone() if args.clone_grads else g
            schedule.gradient_ready(p)  # what the post-accumulate-grad hook calls
        opt.step()
        opt.zero_grad()

    for _ in range(args.warmup):
        one_step()
    times = []
    for _ in range(args.steps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        one_step()
        times.append((time.perf_counter() - t) * 1e3)  # host time: the device may still be running
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    ms = statistics.median(times)
    profiler = None
    if args.profile:  # separate, profiled steps (the profiler's own cost stays out of the timing)
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(3):
            one_step()
        profiler.disable()
    print(f"release host cost: {len(params)} parameters, preset {args.preset}, max_grad_norm {args.max_grad_norm}, "
          f"batches {args.batches or 'default'}, "
          f"device {device}{' (kernels stubbed)' if device.type == 'cpu' else ''}, torch {torch.__version__}")
    print(f"| host ms per step (median of {args.steps}) | us per parameter | min ms | max ms |")
    print("|---:|---:|---:|---:|")
    print(f"| {ms:.2f} | {1e3 * ms / len(params):.1f} | {min(times):.2f} | {max(times):.2f} |")
    if profiler:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(args.profile)
    return {"ms": ms, "params": len(params)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="bf16w-4bit-lean")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--ffn", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--max-grad-norm", type=float, default=None)
    parser.add_argument("--batches", type=int, default=None,
                        help="release in about this many batches a step (release_bucket_bytes = gradient bytes / N; "
                             "the 0.95B model takes 8 at the default 256 MiB); default: wrap's default bucket")
    parser.add_argument("--clone-grads", action="store_true", help="a new gradient tensor every step, as autograd makes")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--profile", type=int, default=0, help="print cProfile's top N functions by own time")
    run(parser.parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
