"""Host (Python/launch) cost of the offloaded int8 step on the CPU, with and without backward-time
prefetch, beside the resident int8 step.

The parameter list has the shape of the 0.95B e2e model (``optstate bench --e2e``: same number of
tensors, same order and rank, matrices with whole 256-column tiles) with every tensor scaled down
(about 3.8M elements in all), so the per-tensor host work dominates; the staging ring is scaled by
the same factor, so offloaded state streams in as many chunks as on the GPU. The fused path runs
on the CPU (``TRITON_INTERPRET=1``, ``fused=True``) with the kernel bodies stubbed out: what is
timed is the host side (plans, tables, staging, copy calls, events), plus memcpy of ~8 MB of
state each way. Gradients arrive in reverse parameter order through the real
post-accumulate-grad hooks, as in backward.

    python tools/offload_host_cost.py [--steps 20] [--warmup 3] [--profile] [--config NAME]

Columns: host ms per ``step()`` and in hooks during backward (median over steps, time.perf_counter),
and per step the calls a CUDA run would turn into driver work: kernel launches (Triton), tensors
copied (each a ``cudaMemcpyAsync`` on a GPU), events recorded and stream waits (as on CUDA: the CPU
has none, they are counted where the code asks for them), device tables built (each a pinned
upload; on the CPU gradients land at new addresses every step, on a GPU mostly not) and
``torch.empty`` calls (staged copies, per-launch scratch). The last line gives a memcpy floor: the
same bytes in one copy per direction.
"""
import argparse
import cProfile
import io
import os
import pstats
import statistics
from collections import Counter
import sys
import time
from contextlib import contextmanager

os.environ["TRITON_INTERPRET"] = "1"  # the fused path takes CPU tensors only under the interpreter

import torch  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import optstate_core as oc  # noqa: E402
from optstate_core.apps.llama import NAMED_SHAPES  # noqa: E402

REAL_STAGING = 256 * 2**20  # the optimizer's default staging_bytes


def llama_list_shapes(shape, row_div=32, col_div=8):
    """The parameter shapes of the Llama-shaped model in ``named_parameters()`` order, scaled:
    rows / ``row_div``, columns / ``col_div`` rounded to whole 256-element tiles (1-D: columns)."""
    def cols(c):
        return max(256, round(c / col_div / 256) * 256)

    def mat(r, c):
        return (max(1, r // row_div), cols(c))

    h, f, v = shape.hidden, shape.ffn, shape.vocab
    kv = shape.kv_heads * (h // shape.heads)
    real = [(v, h)]
    for _ in range(shape.layers):
        real += [(h, h), (kv, h), (kv, h), (h, h), (f, h), (f, h), (h, f), (h,), (h,)]
    real += [(h,), (v, h)]
    scaled = [mat(*s) if len(s) == 2 else (cols(s[0]),) for s in real]
    return real, scaled


class StubKernel:
    """Stands in for a Triton kernel: ``kernel[grid](*args)`` counts the launch and does nothing."""

    def __init__(self, counter):
        self.counter = counter

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.counter["kernel launches"] += 1
        return run


@contextmanager
def counting(counter):
    """Count the calls that turn into driver work on CUDA (patched in; not used while timing)."""
    from optstate_core import prefetch, transfer
    from optstate_core.kernels import launch

    saved = [(torch.Tensor, "copy_", torch.Tensor.copy_), (torch, "_foreach_copy_", torch._foreach_copy_),
             (transfer.Streams, "event", transfer.Streams.event), (transfer.Streams, "wait", transfer.Streams.wait),
             (launch, "device_table", launch.device_table), (torch, "empty", torch.empty),
             (prefetch.PrefetchArea, "mark", prefetch.PrefetchArea.mark)]
    copy_, foreach, event, wait, table, empty, mark = (s[2] for s in saved)
    marked = set()

    def c_copy(self, *a, **k):
        counter["tensors copied"] += 1
        return copy_(self, *a, **k)

    def c_foreach(dst, *a, **k):
        counter["tensors copied"] += len(dst)
        return foreach(dst, *a, **k)

    def c_event(self, *a, **k):
        counter["events"] += 1
        return event(self, *a, **k)

    def c_wait(self, stream, ev):
        counter["stream waits"] += 1
        return wait(self, stream, ev)

    def c_table(*a, **k):
        counter["tables built"] += 1
        return table(*a, **k)

    def c_empty(*a, **k):
        counter["torch.empty"] += 1
        return empty(*a, **k)

    def c_mark(self, which, make_event):
        if which.endswith("start") and which in marked:  # on CUDA the first start event is kept:
            return  # the CPU (no events) would ask again
        marked.add(which)
        return mark(self, which, make_event)

    for (obj, name, _), new in zip(saved, (c_copy, c_foreach, c_event, c_wait, c_table, c_empty, c_mark)):
        setattr(obj, name, new)
    try:
        yield
    finally:
        for obj, name, old in saved:
            setattr(obj, name, old)


def configs(staging):
    def ours(**options):
        return lambda ps: oc.wrap(torch.optim.AdamW(ps, lr=1e-3), oc.make_policy("8bit"), fused=True,
                                  staging_bytes=staging, **options)
    return {
        "int8 resident": ours(),
        "int8 offloaded, prefetch off": ours(offload=True, prefetch_budget=0),
        "int8 offloaded, prefetch auto": ours(offload=True, prefetch_budget="auto"),
    }


class Run:
    """Parameters, gradients and one optimizer; ``train_step`` = hooks (reverse order) + step()."""

    def __init__(self, shapes, build):
        gen = torch.Generator().manual_seed(0)
        self.params = [torch.nn.Parameter(torch.randn(s, generator=gen) * 0.02) for s in shapes]
        self.grads = [torch.randn(s, generator=gen) * 1e-3 for s in shapes]
        self.opt = build(self.params)
        self.hook_s = 0.0
        self.profiles = None  # (hooks, step()) cProfile.Profile while profiling
        schedule = self.opt._engine.schedule
        ready = schedule.gradient_ready

        def timed(param):
            if self.profiles:
                self.profiles[0].enable()
            t = time.perf_counter()
            ready(param)
            self.hook_s += time.perf_counter() - t
            if self.profiles:
                self.profiles[0].disable()
        schedule.gradient_ready = timed  # the hooks call it through the schedule instance

    def train_step(self):
        """(step() host ms, hook host ms) of one step."""
        self.hook_s = 0.0
        for p, g in zip(reversed(self.params), reversed(self.grads)):
            torch.autograd.backward(p, g.clone())  # AccumulateGrad fires the post-accumulate hook
        if self.profiles:
            self.profiles[1].enable()
        t = time.perf_counter()
        self.opt.step()
        step_s = time.perf_counter() - t
        if self.profiles:
            self.profiles[1].disable()
        self.opt.zero_grad()
        return step_s * 1e3, self.hook_s * 1e3


def memcpy_ms(rows) -> float:
    """Median ms to copy the offloaded state's bytes host -> host once each way (two big copies)."""
    nbytes = max((phases["backward"] + phases["step"] for *_, phases in rows), default=0)
    a, b = torch.ones(max(nbytes, 1), dtype=torch.uint8), torch.empty(max(nbytes, 1), dtype=torch.uint8)
    times = []
    for _ in range(7):
        t = time.perf_counter()
        b.copy_(a)
        a.copy_(b)
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--profile", action="store_true",
                    help="cProfile top-15 (tottime) of each configuration's step() and hooks, over 5 more steps")
    ap.add_argument("--config", action="append", help="only these configurations (repeatable; substring)")
    args = ap.parse_args()

    from optstate_core.kernels import adam

    counter = Counter()
    for name in ("adam_kernel", "bias_corrections_kernel", "advance_steps_kernel"):
        setattr(adam, name, StubKernel(counter))
    real, shapes = llama_list_shapes(NAMED_SHAPES["0.95b"])
    n_real, n = sum(torch.Size(s).numel() for s in real), sum(torch.Size(s).numel() for s in shapes)
    staging = max(4096, REAL_STAGING * n // n_real)
    torch.set_num_threads(1)
    print(f"offload host cost: {len(shapes)} tensors shaped like the 0.95B e2e model ({n_real / 1e9:.2f}B), scaled to "
          f"{n / 1e6:.2f}M elements; staging ring {staging / 2**10:.0f} KiB (256 MiB x the same factor); kernels "
          f"stubbed; CPU, torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    rows, profiles = [], []
    for label, build in configs(staging).items():
        if args.config and not any(c in label for c in args.config):
            continue
        run = Run(shapes, build)
        for _ in range(args.warmup):
            run.train_step()
        times = [run.train_step() for _ in range(args.steps)]
        counter.clear()
        with counting(counter):
            run.train_step()
        steps = [t[0] for t in times]
        hooks = [t[1] for t in times]
        rows.append((label, statistics.median(steps), min(steps), statistics.median(hooks), dict(counter),
                     run.opt.memory_report()["prefetch"]["bytes_by_phase"]))
        if args.profile:
            run.profiles = (cProfile.Profile(), cProfile.Profile())
            for _ in range(5):
                run.train_step()
            for what, prof in zip(("hooks", "step()"), run.profiles):
                if prof.getstats():
                    out = io.StringIO()
                    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(15)
                    profiles.append((f"{label}: {what}", out.getvalue()))
            run.profiles = None
        run.opt.close()
    keys = ["kernel launches", "tensors copied", "events", "stream waits", "tables built", "torch.empty"]
    print("| configuration | step() host ms (median) | min | hooks host ms | " + " | ".join(keys)
          + " | KiB up in backward / step |")
    print("|---|---:|---:|---:|" + "---:|" * len(keys) + "---:|")
    for label, med, low, hook, count, phases in rows:
        print(f"| {label} | {med:.2f} | {low:.2f} | {hook:.2f} | " + " | ".join(str(count.get(k, 0)) for k in keys)
              + f" | {phases['backward'] / 2**10:.0f} / {phases['step'] / 2**10:.0f} |")
    print(f"counts are per step (one counted step after the timed ones); 5 steps per cProfile; memcpy floor "
          f"{memcpy_ms(rows):.2f} ms (the offloaded state's bytes copied once each way, one call per direction)")
    for label, text in profiles:
        print(f"\n### cProfile, {label} (5 steps, by tottime)")
        print("\n".join(line for line in text.splitlines()[4:] if line.strip())[:6000])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
