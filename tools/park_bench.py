#!/usr/bin/env python3
"""The RL phase switch, timed: optstate's park/wake (``offload()``/``reload()``) beside the per-tensor
``.to()`` loop that RL frameworks run on ``torch.optim.AdamW(fused=True)``'s fp32 state.

    python tools/park_bench.py --layers 32 --presets 8bit,bf16w-4bit-lean [--json rows.jsonl]

The parameters have Llama-3-8B's layer shapes (``--layers`` decoder layers, the embedding, the final
norm and the head; ``--biases``: q/k/v/o biases too), are made on the GPU and given one optimizer
step on random gradients (``--steps``), which creates the state; the gradients are then freed.
Each contender runs in a fresh process (pinned memory and the caching allocators start empty,
as in a new training job), ``--cycles`` park/wake cycles each:

- ``optstate <preset>``: ``wrap(torch.optim.AdamW(params), preset)``, ``prepare_park()`` before the
  first step (the host buffers are pinned on a thread after it; ``--no-prepare``: the first park
  pins them itself), then ``offload()`` / ``reload()``;
- ``adamw-loop``: ``torch.optim.AdamW(params, fused=True)``, then every state tensor
  ``.to("cpu", non_blocking=True)`` and back ``.to("cuda", non_blocking=True)`` (verl's
  ``offload_fsdp_optimizer``/``load_fsdp_optimizer``), one synchronize after each loop.

A row per contender and switch (``first``, and ``later``: the median of the other cycles): park and
wake wall-clock seconds (``torch.cuda.synchronize()`` before and after), GB/s of the state's bytes,
``freed_gib`` (``memory_allocated`` before the park minus after it), ``slack_gib``
(``memory_reserved - memory_allocated`` after ``torch.cuda.empty_cache()`` while parked),
``pinned_gib`` (pinned host memory held after the switch: torch's host allocator), ``ahead_s``
(seconds the thread spent pinning optstate's buffers, before the first park). The table is printed
as markdown; ``--json PATH`` appends the rows as JSON lines. ``--max-seconds`` bounds the whole run
(contenders not started in time are listed as skipped). ``--device cpu`` is a smoke run of the same
code on the CPU, in this process (the test uses it; its figures mean nothing).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COLUMNS = ("method", "preset", "params", "state_gib", "switch", "park_s", "wake_s", "park_gbps", "wake_gbps",
           "freed_gib", "slack_gib", "pinned_gib", "ahead_s")
LOOP = "adamw-loop"
FAST_PINNING = "pinned_use_cuda_host_register:True,pinned_num_register_threads:8"
GIB = 2**30


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=8, help="decoder layers of Llama-3-8B's shapes (default 8; 32: the whole model)")
    p.add_argument("--shape", default="8b", help="a named shape of optstate_core.apps.llama (default 8b; tiny for the smoke run)")
    p.add_argument("--biases", action="store_true", help="q/k/v/o biases in every layer (uncompressed tiny state)")
    p.add_argument("--presets", default="8bit,bf16w-4bit-lean", help="optstate presets, comma-separated")
    p.add_argument("--no-loop", action="store_true", help="leave out the per-tensor .to() loop on fused AdamW")
    p.add_argument("--no-prepare", action="store_true", help="no prepare_park(): the first park pins its buffers")
    p.add_argument("--cycles", type=int, default=3, help="park/wake cycles per contender (at least 2; default 3)")
    p.add_argument("--steps", type=int, default=1, help="optimizer steps before the first park (default 1)")
    p.add_argument("--fast-pinning", action="store_true",
                   help=f"PYTORCH_CUDA_ALLOC_CONF={FAST_PINNING} in the contenders' processes")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: the smoke run (in this process)")
    p.add_argument("--max-seconds", type=float, default=1800.0, help="time box of the whole run (default 1800)")
    p.add_argument("--json", default=None, help="append the rows to this JSON-lines file")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: run one contender, print its rows
    args = p.parse_args(argv)
    if args.layers < 1:
        p.error(f"--layers must be at least 1, got {args.layers}")
    if args.cycles < 2:
        p.error(f"--cycles must be at least 2 (a first switch and a later one), got {args.cycles}")
    if args.steps < 1:
        p.error(f"--steps must be at least 1, got {args.steps}")
    if args.max_seconds <= 0:
        p.error(f"--max-seconds must be positive, got {args.max_seconds}")
    if str(ROOT) not in sys.path:  # run from a checkout: its optstate_core
        sys.path.insert(0, str(ROOT))
    from optstate_core import PRESETS
    from optstate_core.apps.llama import NAMED_SHAPES
    if args.shape not in NAMED_SHAPES:
        p.error(f"--shape must be one of {', '.join(NAMED_SHAPES)}, got {args.shape!r}")
    args.preset_list = [s.strip() for s in args.presets.split(",") if s.strip()]
    bad = [s for s in args.preset_list if s not in PRESETS]
    if bad:
        p.error(f"--presets: unknown {', '.join(bad)}; valid: {', '.join(sorted(PRESETS))}")
    return args


def contenders(args) -> list:
    return [f"optstate:{p}" for p in args.preset_list] + ([] if args.no_loop else [LOOP])


def shapes(args) -> list:
    """The parameter shapes: ``--shape``'s layers (``--layers`` of them), embedding, norm, head."""
    from optstate_core.apps.llama import NAMED_SHAPES
    from optstate_core.apps.model_shapes import config_shapes
    config = dict(NAMED_SHAPES[args.shape].hf_config(), num_hidden_layers=args.layers, attention_bias=args.biases)
    return [shape for _, shape in config_shapes(config)]


def _sync(device) -> None:
    if device.type == "cuda":
        import torch
        torch.cuda.synchronize(device)


def _memory(device):
    """(allocated, reserved) device bytes (zeros on the CPU)."""
    import torch
    if device.type != "cuda":
        return 0, 0
    return torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)


def _pinned(device, fallback=None):
    import torch
    if device.type == "cuda":
        stats = torch.cuda.host_memory_stats()
        if "allocated_bytes.current" in stats:
            return stats["allocated_bytes.current"]
    return fallback


def _params(shape_list, device, dtype):
    import torch
    gen = torch.Generator(device=device).manual_seed(0)
    return [torch.nn.Parameter(torch.empty(s, device=device, dtype=dtype).normal_(0, 0.02, generator=gen))
            for s in shape_list]


def _train(opt, params, steps) -> None:
    import torch
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn_like(p).mul_(1e-3)
        opt.step()
        opt.zero_grad(set_to_none=True)


class LoopSwitch:
    """The per-tensor loop on a torch optimizer's state (every tensor, step counters included)."""

    def __init__(self, opt, device):
        self.opt, self.device = opt, device

    def move(self, device) -> None:
        import torch
        for st in self.opt.state.values():
            for key, value in st.items():
                if isinstance(value, torch.Tensor):
                    st[key] = value.to(device, non_blocking=True)

    def park(self) -> None:
        self.move("cpu")

    def wake(self) -> None:
        self.move(self.device)

    def state_bytes(self) -> int:
        import torch
        return sum(v.numel() * v.element_size() for st in self.opt.state.values() for v in st.values()
                   if isinstance(v, torch.Tensor))

    def pinned(self):
        return _pinned(self.device)

    def ahead_s(self):
        return None


class OptstateSwitch:
    def __init__(self, opt, device):
        self.opt, self.device = opt, device

    def park(self) -> None:
        self.opt.offload()

    def wake(self) -> None:
        self.opt.reload()

    def state_bytes(self) -> int:
        return self.opt.memory_report()["device_bytes"]

    def pinned(self):
        return _pinned(self.device, self.opt.memory_report()["park_buffers"]["pinned_bytes"])

    def ahead_s(self):
        return self.opt.memory_report()["park_buffers"]["prepare_seconds"]


def run_one(args, contender: str) -> list:
    """One contender in this process: its rows (first and later switches)."""
    import torch
    import optstate_core as oc
    device = torch.device(args.device)
    shape_list = shapes(args)
    if contender == LOOP:
        method, preset = LOOP, "fp32 (fused AdamW)"
        params = _params(shape_list, device, torch.float32)
        opt = torch.optim.AdamW(params, lr=1e-5, weight_decay=0.01, fused=device.type == "cuda")
        switch = LoopSwitch(opt, device)
    else:
        method, preset = "optstate", contender.split(":", 1)[1]
        dtype = torch.bfloat16 if oc.presets.has_master_weights(preset) else torch.float32
        params = _params(shape_list, device, dtype)
        opt = oc.wrap(torch.optim.AdamW(params, lr=1e-5, weight_decay=0.01), preset)
        if not args.no_prepare:
            opt.prepare_park()
        switch = OptstateSwitch(opt, device)
    _train(opt, params, args.steps)
    if contender != LOOP and not args.no_prepare:
        opt.prepare_park(wait=True)  # what a training phase after the first step leaves time for
    _sync(device)
    state = switch.state_bytes()
    cycles = []
    for _ in range(args.cycles):
        _sync(device)
        before, _ = _memory(device)
        t0 = time.perf_counter()
        switch.park()
        _sync(device)
        park_s = time.perf_counter() - t0
        after, _ = _memory(device)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        allocated, reserved = _memory(device)
        pinned = switch.pinned()
        t0 = time.perf_counter()
        switch.wake()
        _sync(device)
        cycles.append({"park_s": park_s, "wake_s": time.perf_counter() - t0, "freed": before - after,
                       "slack": reserved - allocated, "pinned": pinned})
    base = {"method": method, "preset": preset, "params": sum(p.numel() for p in params), "state_gib": state / GIB,
            "ahead_s": switch.ahead_s(), "device": str(device), "layers": args.layers,
            "fast_pinning": "host_register" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
            "prepared": contender != LOOP and not args.no_prepare}
    rows = []
    for name, chosen in (("first", cycles[:1]), ("later", cycles[1:])):
        park_s = statistics.median(c["park_s"] for c in chosen)
        wake_s = statistics.median(c["wake_s"] for c in chosen)
        last = chosen[-1]
        rows.append(dict(base, switch=name, park_s=park_s, wake_s=wake_s,
                         park_gbps=state / park_s / 1e9 if park_s > 0 else None,
                         wake_gbps=state / wake_s / 1e9 if wake_s > 0 else None,
                         freed_gib=last["freed"] / GIB, slack_gib=last["slack"] / GIB,
                         pinned_gib=None if last["pinned"] is None else last["pinned"] / GIB))
    return rows


def _subprocess(args, contender: str, argv, timeout: float) -> list:
    env = dict(os.environ)
    if args.fast_pinning:
        env["PYTORCH_CUDA_ALLOC_CONF"] = FAST_PINNING
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "integrations"), env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, str(Path(__file__).resolve()), *argv, "--one", contender],
                         capture_output=True, text=True, timeout=timeout, env=env)
    if run.returncode != 0:
        raise RuntimeError(f"{contender} failed:\n{run.stderr[-3000:]}")
    return [json.loads(line[len("ROW "):]) for line in run.stdout.splitlines() if line.startswith("ROW ")]


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 100 else f"{value:.1f}"
    return str(value)


def table(rows) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_cell(r.get(c)) for c in COLUMNS) + " |" for r in rows]
    return "\n".join(lines)


def main(argv=None) -> list:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.one is not None:
        for row in run_one(args, args.one):
            print("ROW " + json.dumps(row), flush=True)
        return []
    start = time.perf_counter()
    rows, skipped = [], []
    for contender in contenders(args):
        left = args.max_seconds - (time.perf_counter() - start)
        if left <= 0:
            skipped.append(contender)
            continue
        try:
            new = run_one(args, contender) if args.device == "cpu" else _subprocess(args, contender, argv, left)
        except subprocess.TimeoutExpired:
            skipped.append(contender)
            continue
        rows += new
        if args.json:
            with open(args.json, "a") as f:
                for row in new:
                    f.write(json.dumps(row) + "\n")
    print(table(rows))
    if skipped:
        print(f"\nskipped (--max-seconds {args.max_seconds:g} reached): {', '.join(skipped)}")
    return rows


if __name__ == "__main__":
    main()
