"""A CUDA-event timeline of two training steps of examples/finetune_8b_24gb.py, without a profiler
(which inflates an offloaded step twofold): the copies on the upload and write-back streams, each
release batch's update on the compute stream, the forward's end; then per step the busy time of
each stream in 20 ms bins, whether updates waited for their uploads, how far the device ran
behind the host (a lag near 0 through backward: the host is the bottleneck), and Python's GC
passes inside the step (host time; a full pass over a model's objects took 0.3 s, docs/benchmarks-journal.md
section 31).

    python tools/step_timeline.py --out T.txt [--json] -- --gpu-memory 24GB --micro-batch 1 --steps 6
    python tools/step_timeline.py --summarize T.txt.json      # again from saved rows

Everything after ``--`` goes to the example; the two steps after its warm-up are recorded. The
hooks wrap the schedule's methods from outside (``Streams.on``, ``StepSchedule.run``,
``KernelLauncher.launch``, ``ClipAndRelease.flush``); nothing in the library changes.
"""
import argparse
import atexit
import contextlib
import gc
import importlib.util
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "integrations")]

RECORDING = {"on": False, "events": []}  # (label, event or None (host only), host seconds, extra)


def record(label, stream=None, extra=None):
    import torch
    if not RECORDING["on"] or not torch.cuda.is_available():
        return
    event = torch.cuda.Event(enable_timing=True)
    event.record(stream if stream is not None else torch.cuda.current_stream())
    RECORDING["events"].append((label, event, time.perf_counter(), extra))


def install(example):
    """Wrap the schedule's copy, update and flush points and the example's step timer."""
    from optstate_core.schedule import release, timetable, transfer
    from optstate_core.step import fused_launch

    on = transfer.Streams.on

    @contextlib.contextmanager
    def timed_on(self, stream):
        kind = "h2d" if stream is self.h2d else "d2h" if stream is self.d2h else "other"
        record(kind + "_begin", stream)
        with on(self, stream):
            yield
        record(kind + "_end", stream)
    transfer.Streams.on = timed_on

    def around(cls, name, before, after=None):
        inner = getattr(cls, name)

        def wrapped(self, *a, **k):
            record(before, extra=k.get("final", a[0] if a and isinstance(a[0], bool) else None))
            out = inner(self, *a, **k)
            if after:
                record(after)
            return out
        setattr(cls, name, wrapped)
    around(timetable.StepSchedule, "run", "run_begin", "run_end")
    around(fused_launch.KernelLauncher, "launch", "kernel_begin")
    around(release.ClipAndRelease, "flush", "flush")

    load = example.load_model

    def load_model(args):
        model = load(args)
        model.register_forward_hook(lambda *_: record("fwd_end"))
        return model
    example.load_model = load_model

    def gc_pause(phase, info):  # a host-only row per GC pass: (generation, milliseconds)
        if phase == "start":
            gc_pause.t = time.perf_counter()
        elif RECORDING["on"] and gc_pause.t is not None:
            RECORDING["events"].append(("gc", None, gc_pause.t,
                                        (info["generation"], (time.perf_counter() - gc_pause.t) * 1e3)))
    gc_pause.t = None
    gc.callbacks.append(gc_pause)

    timer = example.StepTimer
    begin, end = timer.begin, timer.end

    def timed_begin(self):
        begin(self)
        if self._i in (self.warmup + 1, self.warmup + 2):
            RECORDING["on"] = True
        record("step_begin", extra=self._i)

    def timed_end(self, loss=None):
        record("step_end", extra=self._i)
        i = self._i
        end(self, loss)
        if i in (self.warmup + 2, self.steps - 1):
            RECORDING["on"] = False
    timer.begin, timer.end = timed_begin, timed_end


def intervals(rows, kind):
    """(gpu start, gpu end, host start, host end) of each ``kind`` copy call."""
    out, open_ = [], []
    for label, gpu, host, _ in rows:
        if label == kind + "_begin":
            open_.append((gpu, host))
        elif label == kind + "_end" and open_:
            g, h = open_.pop(0)
            out.append((g, gpu, h, host))
    return out


def busy(spans) -> float:
    """Milliseconds covered by the union of ``spans`` (start, end, ...)."""
    total, cur = 0.0, None
    for s, e, *_ in sorted(spans):
        if cur is None or s > cur[1]:
            total += (cur[1] - cur[0]) if cur else 0.0
            cur = [s, e]
        else:
            cur[1] = max(cur[1], e)
    return total + ((cur[1] - cur[0]) if cur else 0.0)


def summarize(rows, bin_ms=20):
    """Per recorded step: forward end, flushes, copy and update busy time, update stalls, the
    device's lag behind the host at each flush, host time inside the flushes, busy bins."""
    lines = []
    begins = [r for r in rows if r[0] == "step_begin"]
    ends = [r for r in rows if r[0] == "step_end"]
    for b, e in zip(begins, ends):
        lo, hi = b[1], e[1]
        step = [(lab, g - lo, h - b[2], x) for lab, g, h, x in rows if b[2] <= h <= e[2] and g is not None]
        lines.append(f"== step {b[3]}: {hi - lo:.1f} ms on the device, {e[2] - b[2]:.1f} ms on the host")
        passes = [x for lab, g, h, x in rows if lab == "gc" and b[2] <= h <= e[2]]
        full = [ms for generation, ms in passes if generation == 2]
        lines.append(f"  Python GC: {len(passes)} passes, {sum(ms for _, ms in passes):.1f} ms on the host; "
                     f"{len(full)} full, {sum(full):.1f} ms")
        for lab, g, h, _ in step:
            if lab == "fwd_end":
                lines.append(f"  forward ends: device {g:.1f} ms, host {h:.1f} ms")
        flushes = [r for r in step if r[0] == "flush" and r[3] is not True]
        if flushes:
            lags = sorted(g - h for _, g, h, _ in flushes)
            lines.append(f"  {len(flushes)} release batches, device {flushes[0][1]:.1f}..{flushes[-1][1]:.1f} ms; "
                         f"device lag behind the host at a flush: median {lags[len(lags) // 2]:.1f} ms, "
                         f"max {lags[-1]:.1f} ms")
            idx = [i for i, r in enumerate(step) if r[0] == "flush" and r[3] is not True]
            inside = sum(step[j - 1][2] - step[i][2] for i, j in zip(idx, idx[1:]))
            lines.append(f"  host time from each flush to its last copy call: {inside:.1f} ms")
        for kind in ("h2d", "d2h"):
            spans = intervals(step, kind)
            if spans:
                lines.append(f"  {kind}: {len(spans)} copy calls, device {min(s[0] for s in spans):.1f}.."
                             f"{max(s[1] for s in spans):.1f} ms, busy {busy(spans):.1f} ms")
        runs = intervals(step, "run")
        stall, start = 0.0, None
        for lab, g, _, _ in step:
            if lab == "run_begin":
                start = g
            elif lab == "kernel_begin" and start is not None:
                stall, start = stall + g - start, None
        if runs:
            lines.append(f"  updates: busy {busy(runs):.1f} ms; waited for their uploads {stall:.1f} ms")
        lines.append(f"  bin ms   h2d%  d2h%  update%")
        h2d, d2h = intervals(step, "h2d"), intervals(step, "d2h")
        for t in range(0, int(hi - lo) + 5 * bin_ms, bin_ms):
            def share(spans):
                return busy([(max(s, t), min(e, t + bin_ms)) for s, e, *_ in spans if e > t and s < t + bin_ms]) / bin_ms
            lines.append(f"  {t:6d}  {share(h2d):5.0%} {share(d2h):5.0%} {share(runs):6.0%}")
    return lines


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="step_timeline.txt", help="the summary (text)")
    p.add_argument("--json", action="store_true", help="also write the raw rows to OUT.json")
    p.add_argument("--summarize", metavar="JSON", help="summarize saved rows instead of running")
    args = p.parse_args(argv[:split])
    if args.summarize:
        print("\n".join(summarize(json.load(open(args.summarize)))))
        return
    spec = importlib.util.spec_from_file_location("finetune_8b_24gb", os.path.join(ROOT, "examples", "finetune_8b_24gb.py"))
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    install(example)

    @atexit.register
    def write():
        import torch
        events = RECORDING["events"]
        if not events:
            return
        torch.cuda.synchronize()
        _, t0, h0, _ = next(ev for ev in events if ev[1] is not None)
        rows = [(lab, t0.elapsed_time(e) if e is not None else None, (h - h0) * 1e3, x) for lab, e, h, x in events]
        if args.json:
            json.dump(rows, open(args.out + ".json", "w"))
        lines = summarize(rows)
        open(args.out, "w").write("\n".join(lines) + "\n")
        print("\n".join(lines[:12]))
    example.main(argv[split + 1:])


if __name__ == "__main__":
    main()
