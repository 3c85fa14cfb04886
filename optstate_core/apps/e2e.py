"""End-to-end training step benchmark: ``optstate bench --e2e``.

A Llama-shaped causal LM built from a config (no downloads), fp32 master parameters, bf16
autocast, forward + backward + optimizer step on random tokens; every configuration in one
process against ``torch.optim.AdamW(fused=True)`` on resident fp32 state. Offloaded
configurations print their floor: forward+backward time alone plus the encoded state that
cannot stay on the GPU, moved both ways over the measured pinned bandwidth.
"""
from __future__ import annotations

import gc
import logging
import os
import re
import statistics
import time

import torch

log = logging.getLogger("optstate")


def build_model(hidden: int, layers: int, vocab: int, ffn: int, device):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                         num_attention_heads=max(1, hidden // 128), num_key_value_heads=max(1, hidden // 128),
                         vocab_size=vocab, max_position_embeddings=4096, tie_word_embeddings=False)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    return model.float().train()


def train_step(model, tokens, opt):
    """One training step (bf16 autocast forward, backward, ``opt.step()`` unless None); the loss.
    Each phase is a ``record_function`` range (``fwd``, ``bwd``, ``step``) for ``--trace``."""
    from torch.profiler import record_function

    with record_function("fwd"), torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(input_ids=tokens, labels=tokens).loss
    with record_function("bwd"):
        loss.backward()
    with record_function("step"):
        if opt is not None:
            opt.step()
        model.zero_grad(set_to_none=True)
    return loss


def trace_steps(model, tokens, opt, path: str, steps: int = 3) -> None:
    """Profile ``steps`` back-to-back training steps (CPU and CUDA) into a chrome trace at ``path``
    (summarised by ``tools/trace_timeline.py``)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
        for _ in range(steps):
            train_step(model, tokens, opt)
        torch.cuda.synchronize()
    prof.export_chrome_trace(path)


def e2e_configs(n_params: int, compare: bool, budget_fraction: float):
    from ..presets import make_policy, wrap

    fp32_state = 8 * n_params
    budget = int(fp32_state * budget_fraction)

    def ours(preset, **options):
        return lambda ps: wrap(torch.optim.AdamW(ps, fused=True), make_policy(preset), **options)

    out = {
        "forward+backward only": None,
        "torch AdamW fused": lambda ps: torch.optim.AdamW(ps, fused=True),
        "optstate fp32 (passthrough)": ours("fp32"),
        "optstate int8 resident": ours("8bit"),
        "optstate 4bit resident": ours("4bit"),
        # offloaded rows: the default (backward-time prefetch, "auto") and the staging ring alone beside it
        "optstate int8 offloaded, prefetch auto (default)": ours("8bit", offload=True),
        "optstate int8 offloaded, prefetch off": ours("8bit", offload=True, prefetch_budget=0),
        f"optstate 4bit, gpu_budget={budget / 2**30:.2f} GiB, prefetch auto (default)": ours("4bit", gpu_budget=budget),
        f"optstate 4bit, gpu_budget={budget / 2**30:.2f} GiB, prefetch off":
            ours("4bit", gpu_budget=budget, prefetch_budget=0),
    }
    if compare:
        try:
            from torchao.optim import CPUOffloadOptimizer
            out["torchao CPUOffloadOptimizer(AdamW fused)"] = \
                lambda ps: CPUOffloadOptimizer(ps, torch.optim.AdamW, fused=True)
        except Exception as e:
            log.info("torchao not available: %s", e)
    return out, budget


def contender_configs(names: str, max_grad_norm: float, clip_all: bool = False):
    """``--optimizers`` for --e2e: contenders by name (:mod:`~optstate_core.apps.contenders`), each
    ``(label, build(params, model), weights dtype)``; optstate rows with gradient release clip with
    ``max_grad_norm`` (by its release default, ``clip_mode="auto"``); with ``clip_all`` the optstate
    rows without release clip too (globally, in ``step()``), so that a preset with and without release
    does the same work; the other rows do not clip."""
    from . import contenders
    out = {}
    for name in (n.strip() for n in names.split(",") if n.strip()):
        c = contenders.parse(name)
        why = contenders.unavailable(c)
        if why is not None:
            log.warning("e2e: %s skipped: %s", name, why)
            continue
        clip = max_grad_norm if c.preset is not None and (c.release or clip_all) else None
        out[name] = (lambda ps, model, c=c, clip=clip: contenders.build(c, ps, model, max_grad_norm=clip), c.weights)
    return out


def run_e2e(args) -> int:
    from .measure import pinned_bandwidth

    device = torch.device(args.device or "cuda")
    if device.type != "cuda":
        raise SystemExit("--e2e needs a CUDA device")
    torch.manual_seed(0)
    model = build_model(args.hidden, args.layers, args.vocab, args.ffn, device)
    params = [p for p in model.parameters() if p.requires_grad]
    n = sum(p.numel() for p in params)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq), device=device)
    if args.optimizers:
        configs, budget = {"forward+backward only": None, **contender_configs(args.optimizers, 1.0, args.clip_all)}, 0
    else:
        configs, budget = e2e_configs(n, args.compare, args.budget_fraction)
        configs = {label: (None if b is None else (lambda ps, model, b=b: b(ps)), torch.float32)
                   for label, b in configs.items()}
    bandwidth = pinned_bandwidth(device)
    rows = []
    for label, entry in configs.items():
        log.info("e2e: %s", label)
        build, weights = entry if entry is not None else (None, torch.float32)
        if weights != next(model.parameters()).dtype:  # bf16 weights (and fp32 masters as state): cast once
            from ..state.master_weights import cast_model
            model.load_state_dict(initial)
            cast_model(model)
            params = [p for p in model.parameters() if p.requires_grad]
        model.load_state_dict(initial)
        model.zero_grad(set_to_none=True)
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        try:
            opt = build(params, model) if build is not None else None
            times, held = [], 0
            for i in range(args.warmup + args.steps):
                torch.cuda.synchronize()
                if i == args.warmup:
                    torch.cuda.reset_peak_memory_stats(device)
                t = time.perf_counter()
                loss = train_step(model, tokens, opt)
                torch.cuda.synchronize()
                if i >= args.warmup:
                    times.append((time.perf_counter() - t) * 1e3)
            # back to back, as a training loop runs: no synchronisation between steps (write-backs
            # may run behind the next forward); wall clock until the device is idle, per step
            t = time.perf_counter()
            for _ in range(args.steps):
                loss = train_step(model, tokens, opt)
            torch.cuda.synchronize()
            back_to_back = (time.perf_counter() - t) * 1e3 / args.steps
            if args.trace:
                os.makedirs(args.trace, exist_ok=True)
                trace_steps(model, tokens, opt, os.path.join(args.trace, re.sub(r"[^\w.+-]+", "_", label) + ".json"))
            base = sum(p.numel() * p.element_size() for p in params)
            held = torch.cuda.memory_allocated(device) - base  # grads are freed: optimizer + leftovers
            report = opt.memory_report() if hasattr(opt, "memory_report") else None
            rows.append((label, statistics.median(times), back_to_back, torch.cuda.max_memory_allocated(device) / 2**30,
                         held, report, loss.item()))
        except Exception as e:
            log.warning("e2e: %s failed: %s", label, e)
            rows.append((label, None, None, None, None, None, None))
        finally:
            if opt is not None and hasattr(opt, "close"):
                opt.close()  # optstate's hooks go with it
            handle = getattr(opt, "_optstate_release_handle", None)  # flashoptim's gradient-release hooks
            if handle is not None:
                (handle.remove if hasattr(handle, "remove") else handle)()
            opt = None
    fwd_bwd, fwd_bwd_peak = rows[0][1], rows[0][3]
    ref = next((r[1] for r in rows if r[0] in ("torch AdamW fused", "adamw")), None)
    ref_b2b = next((r[2] for r in rows if r[0] in ("torch AdamW fused", "adamw")), None)
    print(f"\ntraining step end to end: Llama-shaped {n / 1e9:.3f}B params (hidden {args.hidden}, {args.layers} "
          f"layers, vocab {args.vocab}), batch {args.batch}x{args.seq}, fp32 master weights, bf16 autocast, "
          f"device {torch.cuda.get_device_name(device)}, torch {torch.__version__}")
    print("| configuration | step ms (synced) | x fused | back-to-back ms/step | x fused | peak GPU GiB | x fwd+bwd peak "
          "| optimizer GPU MiB between steps | floor ms | x floor | uploaded in backward MiB | copy ms beside compute |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for label, ms, b2b, peak, held, report, loss in rows:
        if ms is None:
            print(f"| {label} | failed | | | | | | | | | | |")
            continue
        x_peak = f"{peak / fwd_bwd_peak:.2f}" if fwd_bwd_peak else ""
        staged = hidden = ""
        if report is not None and report["host_bytes"]:
            pre = report["prefetch"]
            staged = f"{pre['bytes_by_phase']['backward'] / 2**20:.0f}"
            hidden = "" if pre["hidden_ms"] is None else f"{pre['hidden_ms']:.1f}"
        floor = ""
        ratio_floor = ""
        if report is not None and report["host_bytes"]:  # T + max(0, S - B) / bandwidth
            floor_ms = fwd_bwd + report["host_bytes"] / bandwidth * 1e3
            floor, ratio_floor = f"{floor_ms:.1f}", f"{ms / floor_ms:.2f}"
        opt_mib = "" if report is None else f"{report['device_bytes'] / 2**20:.0f}"
        x_fused = f"{ms / ref:.2f}" if ref else ""
        x_b2b = f"{b2b / ref_b2b:.2f}" if ref_b2b else ""
        print(f"| {label} | {ms:.1f} | {x_fused} | {b2b:.1f} | {x_b2b} | {peak:.1f} | {x_peak} | {opt_mib} | {floor} "
              f"| {ratio_floor} | {staged} | {hidden} |")
    print(f"pinned host<->device bandwidth {bandwidth / 1e9:.1f} GB/s; gpu_budget {budget / 2**30:.2f} GiB "
          f"(= {args.budget_fraction:.4f} of fp32 AdamW state); floor = forward+backward alone "
          f"({fwd_bwd:.1f} ms) + host-resident encoded state / that bandwidth (uploads and write-backs overlap); "
          f"step ms (synced): median with a device synchronisation after every step; back-to-back: "
          f"{args.steps} steps without one, wall clock until the device is idle, per step (what a training loop sees); "
          f"x fwd+bwd peak: peak GPU memory over the forward+backward-only run's; copy ms beside compute: spans "
          f"of the last step's uploads during backward and of its write-backs (memory_report()['prefetch'])")
    if args.optimizers:
        print("clipping: optstate rows with release clip at 1.0 (clip_mode 'auto')" +
              ("; optstate rows without release clip globally at 1.0 (--clip-all)" if args.clip_all else
               "; the rows without release do not clip (--clip-all makes optstate's clip)"))
    return 0


def add_arguments(parser) -> None:
    g = parser.add_argument_group("--e2e (end-to-end training step)")
    g.add_argument("--e2e", action="store_true", help="time forward+backward+step of a Llama-shaped model")
    g.add_argument("--clip-all", action="store_true",
                   help="with --optimizers: optstate rows without release clip at 1.0 too (global clipping in step()), "
                        "as the release rows do")
    g.add_argument("--trace", default=None, metavar="DIR",
                   help="also profile 3 steps per configuration into DIR/<configuration>.json (chrome traces)")
    g.add_argument("--hidden", type=int, default=2048)
    g.add_argument("--e2e-layers", dest="layers_e2e", type=int, default=16)
    g.add_argument("--vocab", type=int, default=32000)
    g.add_argument("--ffn", type=int, default=5632)
    g.add_argument("--batch", type=int, default=None,
                   help="sequences per step (default: 8 for --e2e, 4 for --capacity, 1 for --peak-bytes)")
    g.add_argument("--seq", type=int, default=None,
                   help="tokens per sequence (default: 512 for --e2e and --capacity, 2048 for --peak-bytes)")
