"""Summarise a torch.profiler chrome trace as a timeline: annotated ranges (CPU side and, when
profiled on CUDA, their GPU projection), per-stream busy time and copy bytes inside each range,
and the compute stream's idle gaps with the CPU range they fall in.

    python tools/trace_timeline.py trace.json [--gap-ms 0.3]

Ranges come from ``torch.profiler.record_function`` labels (e.g. fwd / bwd / step per
iteration). Times are ms from the first range's start.
"""
import argparse
import json
from collections import defaultdict

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def load(path):
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    return [e for e in events if e.get("ph") == "X"]


def ranges(events, cat):
    return sorted(((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events if e.get("cat") == cat),
                  key=lambda r: r[0])


def busy(intervals, lo, hi):
    """Time covered by ``intervals`` inside [lo, hi] (intervals may overlap)."""
    total, end = 0.0, lo
    for a, b in sorted(intervals):
        a, b = max(a, end), min(b, hi)
        if b > a:
            total += b - a
            end = b
    return total


def cpu_ops(events, spans, name, top=25):
    """Print the CPU-side events inside ``spans``: total time (nested events count in their
    parents too) and own time (minus the events nested in them, on the same thread)."""
    inside = sorted((e for e in events if e.get("cat") in ("cpu_op", "cuda_runtime", "python_function", "cuda_driver")
                     and any(a <= e["ts"] < b for a, b in spans)), key=lambda e: (e["tid"], e["ts"], -e["dur"]))
    own = {}
    stack = []  # (end, index) per thread, innermost last
    tid = None
    for i, e in enumerate(inside):
        if e["tid"] != tid:
            stack, tid = [], e["tid"]
        while stack and stack[-1][0] <= e["ts"]:
            stack.pop()
        own[i] = e["dur"]
        if stack:
            own[stack[-1][1]] -= e["dur"]
        stack.append((e["ts"] + e["dur"], i))
    totals = defaultdict(lambda: [0, 0.0, 0.0])
    for i, e in enumerate(inside):
        t = totals[(e["cat"], e["name"][:80])]
        t[0] += 1
        t[1] += e["dur"] / 1e3
        t[2] += own[i] / 1e3
    print(f"CPU events inside the {len(spans)} CPU spans of {name!r} ({sum(b - a for a, b in spans) / 1e3:.1f} ms):")
    print("  own ms  total ms  count  kind  name")
    for (cat, n), (count, total, mine) in sorted(totals.items(), key=lambda kv: -kv[1][2])[:top]:
        print(f"  {mine:7.2f} {total:8.2f} {count:6d}  {cat[:6]}  {n}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--gap-ms", type=float, default=0.3)
    ap.add_argument("--kernels", default=None, help="list the GPU ops inside this range's GPU spans, by total time")
    ap.add_argument("--cpu-ops", default=None, metavar="RANGE",
                    help="list the CPU-side events (torch ops, CUDA runtime calls, Python functions when traced "
                         "with stacks) inside this range's CPU spans, by total and by own time")
    args = ap.parse_args()
    events = load(args.trace)
    cpu = [r for r in ranges(events, "user_annotation") if not r[2].startswith(("Optimizer.", "ProfilerStep"))]
    gpu = ranges(events, "gpu_user_annotation")
    streams = defaultdict(list)  # stream -> [(start, end, kind, bytes)]
    gpu_ops = []
    for e in events:
        if e.get("cat") in GPU_CATS:
            a = e.get("args", {})
            kind = e["cat"] if e["cat"] != "gpu_memcpy" else ("HtoD" if "HtoD" in e["name"] else
                                                               "DtoH" if "DtoH" in e["name"] else "DtoD")
            streams[a.get("stream", e.get("tid"))].append((e["ts"], e["ts"] + e["dur"], kind, a.get("bytes", 0)))
            gpu_ops.append((e["ts"], e["dur"], e["name"]))
    if args.kernels:
        spans = [(a, b) for a, b, n in gpu if n == args.kernels]
        totals = defaultdict(lambda: [0, 0.0])
        for ts, dur, name in gpu_ops:
            if any(a <= ts < b for a, b in spans):
                totals[name[:90]][0] += 1
                totals[name[:90]][1] += dur / 1e3
        print(f"GPU ops inside the {len(spans)} GPU spans of {args.kernels!r} "
              f"({sum((b - a) for a, b in spans) / 1e3:.2f} ms in all):")
        for name, (count, ms_) in sorted(totals.items(), key=lambda kv: -kv[1][1])[:15]:
            print(f"  {ms_:8.3f} ms  {count:5d}x  {name}")
    if args.cpu_ops:
        cpu_ops(events, [(a, b) for a, b, n in cpu if n == args.cpu_ops], args.cpu_ops)
    t0 = min([r[0] for r in cpu + gpu] or [0])
    ms = lambda t: (t - t0) / 1e3  # noqa: E731
    compute = max(streams, key=lambda s: sum(1 for x in streams[s] if x[2] == "kernel")) if streams else None
    print("streams: " + ", ".join(f"{s}{' (compute)' if s == compute else ''}: {len(v)} ops" for s, v in streams.items()))
    print("\n| range | CPU start | CPU ms | GPU start | GPU ms | " +
          " | ".join(f"stream {s} busy ms" for s in streams) + " | HtoD MB | DtoH MB |")
    print("|---|---:|---:|---:|---:|" + "---:|" * len(streams) + "---:|---:|")
    for i, (a, b, name) in enumerate(cpu):
        g = next(((ga, gb) for ga, gb, gn in gpu if gn == name and ga >= a - 1), None)
        lo, hi = g if g else (a, b)
        cells = [f"{busy([(x, y) for x, y, _, _ in v], lo, hi) / 1e3:.1f}" for v in streams.values()]
        moved = {k: sum(n for s in streams.values() for x, y, kind, n in s if kind == k and lo <= x < hi) / 1e6
                 for k in ("HtoD", "DtoH")}
        gpu_cells = f"{ms(g[0]):.1f} | {(g[1] - g[0]) / 1e3:.1f}" if g else " | "
        print(f"| {name} | {ms(a):.1f} | {(b - a) / 1e3:.1f} | {gpu_cells} | " + " | ".join(cells) +
              f" | {moved['HtoD']:.0f} | {moved['DtoH']:.0f} |")
    for kind in ("HtoD", "DtoH"):
        ops = [(x, y, n) for v in streams.values() for x, y, k, n in v if k == kind]
        if ops:
            t = sum(y - x for x, y, _ in ops) / 1e3
            total = sum(n for _, _, n in ops)
            print(f"{kind}: {len(ops)} copies, {total / 1e6:.0f} MB, {t:.1f} ms of copy time "
                  f"({total / max(t, 1e-9) / 1e6:.1f} GB/s while copying), median "
                  f"{sorted(n for _, _, n in ops)[len(ops) // 2] / 1e6:.2f} MB per copy")
    if compute is None:
        return
    ops = sorted((x, y) for x, y, _, _ in streams[compute])
    gaps, end = [], ops[0][0]
    for x, y in ops:
        if x - end > args.gap_ms * 1e3:
            gaps.append((end, x))
        end = max(end, y)
    print(f"\ncompute stream idle gaps > {args.gap_ms} ms: {len(gaps)}, {sum(b - a for a, b in gaps) / 1e3:.1f} ms in all")
    by_range = defaultdict(float)
    for a, b in gaps:
        inside = [name for x, y, name in cpu if x <= a < y]
        by_range[inside[-1] if inside else "(between ranges)"] += (b - a) / 1e3
    for name, t in sorted(by_range.items(), key=lambda kv: -kv[1]):
        print(f"  {name}: {t:.1f} ms idle")
    for a, b in sorted(gaps, key=lambda g: g[0] - g[1])[:12]:
        print(f"  gap at {ms(a):.1f} ms for {(b - a) / 1e3:.2f} ms")


if __name__ == "__main__":
    main()
