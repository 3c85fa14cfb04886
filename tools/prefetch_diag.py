"""Diagnose backward-time prefetch on one GPU: per-step-synchronized vs back-to-back step times of
the 0.95B e2e model for fused AdamW and int8 offloaded with and without prefetch, the host ms spent
in step() and in backward hooks, then a torch.profiler summary of two prefetching steps:
python tools/prefetch_diag.py [--out DIR]."""
import argparse
import os
import time

import torch

from optstate_core.apps.e2e import build_model, train_step
from optstate_core.presets import make_policy, wrap


class HostTimer:
    """Host milliseconds spent inside ``opt.step()`` and (optstate) in the schedule's backward
    hooks, by time.perf_counter around the calls (no synchronisation added)."""

    def __init__(self, opt):
        self.step_ms = self.hook_ms = 0.0
        if opt is None:
            return
        step = opt.step

        def timed_step(*args, **kwargs):
            t = time.perf_counter()
            out = step(*args, **kwargs)
            self.step_ms += (time.perf_counter() - t) * 1e3
            return out
        opt.step = timed_step  # e2e.train_step calls opt.step() through the instance
        schedule = getattr(getattr(opt, "_engine", None), "schedule", None)
        if schedule is not None:
            ready = schedule.gradient_ready

            def timed_hook(param):
                t = time.perf_counter()
                ready(param)
                self.hook_ms += (time.perf_counter() - t) * 1e3
            schedule.gradient_ready = timed_hook  # the hooks call it through the schedule instance

    def reset(self):
        self.step_ms = self.hook_ms = 0.0


def timings(model, tokens, opt, warmup=5, steps=8):
    """(median ms with a sync after every step, mean ms of back-to-back steps synced at the ends,
    host ms per step in opt.step() and in backward hooks during the back-to-back steps)."""
    host = HostTimer(opt)
    for _ in range(warmup):
        train_step(model, tokens, opt)
    synced = []
    for _ in range(steps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        train_step(model, tokens, opt)
        torch.cuda.synchronize()
        synced.append((time.perf_counter() - t) * 1e3)
    torch.cuda.synchronize()
    host.reset()
    t = time.perf_counter()
    for _ in range(steps):
        train_step(model, tokens, opt)
    torch.cuda.synchronize()
    return sorted(synced)[steps // 2], (time.perf_counter() - t) * 1e3 / steps, host.step_ms / steps, \
        host.hook_ms / steps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    torch.manual_seed(0)
    model = build_model(2048, 16, 32000, 5632, "cuda")
    params = list(model.parameters())
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    tokens = torch.randint(0, 32000, (8, 512), device="cuda")
    configs = {
        "forward+backward only": lambda: None,
        "torch AdamW fused": lambda: torch.optim.AdamW(params, fused=True),
        "int8 offloaded, prefetch auto": lambda: wrap(torch.optim.AdamW(params, fused=True), make_policy("8bit"),
                                                      offload=True, prefetch_budget="auto"),
        "int8 offloaded, no prefetch": lambda: wrap(torch.optim.AdamW(params, fused=True), make_policy("8bit"),
                                                    offload=True, prefetch_budget=0),
    }
    print("| configuration | ms, synced every step | ms, back to back | step() host ms | hooks host ms |\n"
          "|---|---:|---:|---:|---:|")
    kept = {}
    for label, build in configs.items():
        model.load_state_dict(initial)
        opt = build()
        synced, b2b, step_host, hook_host = timings(model, tokens, opt)
        print(f"| {label} | {synced:.1f} | {b2b:.1f} | {step_host:.1f} | {hook_host:.1f} |", flush=True)
        if "offloaded" in label:
            kept[label] = opt
            print("memory_report prefetch:", opt.memory_report()["prefetch"], flush=True)
        elif opt is not None and hasattr(opt, "close"):
            opt.close()
    import subprocess
    import sys
    from torch.profiler import ProfilerActivity, profile, record_function
    for label, opt in kept.items():
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):  # back to back, labelled for tools/trace_timeline.py
                with record_function("fwd"), torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = model(input_ids=tokens, labels=tokens).loss
                with record_function("bwd"):
                    loss.backward()
                with record_function("step"):
                    opt.step()
                model.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
        print(f"\n## {label}: profiler, 3 iterations back to back")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
        path = os.path.join(args.out, label.replace(" ", "_").replace(",", "") + "_trace.json")
        prof.export_chrome_trace(path)
        subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "trace_timeline.py"), path], check=False)
        os.remove(path)


if __name__ == "__main__":
    main()
