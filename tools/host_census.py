"""Calls and host milliseconds per training step of each function on gradient release's path
(release flushes, staged uploads, write-backs, launches and their device tables, events, Triton's
kernel launches), while
examples/finetune_8b_24gb.py trains: a count-and-clock census instead of a sampling profile.

    python tools/host_census.py --out C.txt -- --gpu-memory 24GB --micro-batch 1 --steps 8

Everything after ``--`` goes to the example. Steps 3 to the last are averaged; times are inclusive
(a flush contains its launches), measured with ``time.perf_counter`` around each call, so every
call costs about a microsecond more than untraced. The wrappers patch the library's classes from
outside and are removed afterwards; nothing in the library changes. docs/benchmarks-journal.md section 32 has
a census of the 8B recipe.
"""
import argparse
import collections
import functools
import importlib.util
import os
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "integrations")]

#: (module, class or None, method or function names) traced, labelled "<short module>.<name>"
TARGETS = (
    ("optstate_core.schedule.release", "ClipAndRelease", ("__call__", "flush", "step_params", "_clip", "stage_next")),
    ("optstate_core.schedule.release", None, ("_norms_fp32",)),
    ("optstate_core.schedule.timetable", "StepSchedule",
     ("gradient_ready", "run", "_launch_prefetched", "_stream_chunk", "_upload", "stage", "_write_back")),
    ("optstate_core.step.fused_launch", "KernelLauncher", ("launch", "new_flags", "advance_steps", "end_step")),
    ("optstate_core.step.kernels.launch", None, ("cached_tables", "device_table", "work_tables")),
    ("optstate_core.schedule.transfer", "Streams", ("event", "wait")),
    ("triton.runtime.jit", "JITFunction", ("run",)),  # every compiled kernel's launch (not the interpreter's)
)


class Census:
    """Counts and inclusive host seconds per traced function; snapshots at step boundaries."""

    def __init__(self):
        self.calls = collections.Counter()
        self.seconds = collections.Counter()
        self.begins, self.ends = [], []  # (host clock, calls, seconds) at each step's begin and end
        self._undo = []

    def _traced(self, label, fn):
        @functools.wraps(fn)
        def traced(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.calls[label] += 1
                self.seconds[label] += time.perf_counter() - t0
        return traced

    def install(self, targets=TARGETS) -> None:
        """Wrap every target (static methods are skipped: their wrapper would take ``self``)."""
        for module_name, class_name, names in targets:
            try:
                module = importlib.import_module(module_name)
            except ImportError:  # (no Triton)
                continue
            owner = getattr(module, class_name) if class_name else module
            for name in names:
                raw = owner.__dict__.get(name) if class_name else getattr(module, name)
                if raw is None or isinstance(raw, (staticmethod, classmethod)):
                    continue
                label = f"{module_name.rsplit('.', 1)[-1]}.{name}"
                setattr(owner, name, self._traced(label, raw))
                self._undo.append((owner, name, raw))

    def remove(self) -> None:
        for owner, name, raw in reversed(self._undo):
            setattr(owner, name, raw)
        self._undo.clear()

    def snapshot(self, end: bool) -> None:
        (self.ends if end else self.begins).append((time.perf_counter(), self.calls.copy(), self.seconds.copy()))

    def table(self, skip: int = 2) -> list:
        """Per step from the begin of step ``skip`` to the end of the last: calls, ms, us per call."""
        steps = len(self.ends) - skip
        if steps < 1 or len(self.begins) <= skip:
            return [f"no steps after the first {skip} to take a census of"]
        (t0, c0, s0), (t1, c1, s1) = self.begins[skip], self.ends[-1]
        lines = [f"{steps} steps, {1e3 * (t1 - t0) / steps:.1f} ms of host time per step",
                 f"{'function':34s} {'calls/step':>10s} {'ms/step':>9s} {'us/call':>9s}"]
        for label in sorted(set(c1), key=lambda k: -(s1[k] - s0[k])):
            n, s = c1[label] - c0[label], s1[label] - s0[label]
            if n:
                lines.append(f"{label:34s} {n / steps:10.1f} {1e3 * s / steps:9.2f} {1e6 * s / n:9.1f}")
        return lines


def run_example(census: Census, example_args: list) -> None:
    """Run the example with a snapshot at each step's begin and end (those the main thread times)."""
    spec = importlib.util.spec_from_file_location("finetune_8b_24gb", os.path.join(ROOT, "examples",
                                                                                  "finetune_8b_24gb.py"))
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    timer = example.StepTimer
    begin, end = timer.begin, timer.end

    def begin_with_snapshot(self):
        if threading.current_thread() is threading.main_thread():
            census.snapshot(end=False)
        return begin(self)

    def end_with_snapshot(self, *args, **kwargs):
        out = end(self, *args, **kwargs)
        if threading.current_thread() is threading.main_thread():
            census.snapshot(end=True)
        return out

    timer.begin, timer.end = begin_with_snapshot, end_with_snapshot
    try:
        example.main(example_args)
    finally:
        timer.begin, timer.end = begin, end


def main(argv=None) -> list:
    argv = sys.argv[1:] if argv is None else argv
    ours, example_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="write the table here too")
    parser.add_argument("--skip", type=int, default=2, help="steps left out of the average (warm-up)")
    args = parser.parse_args(ours)
    census = Census()
    census.install()
    try:
        run_example(census, example_args)
    finally:
        census.remove()
    lines = census.table(args.skip)
    print("\n".join(lines))
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return lines


if __name__ == "__main__":
    main()
