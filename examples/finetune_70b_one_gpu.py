#!/usr/bin/env python3
"""Fully fine-tune a Llama on one GPU with its decoder layers' weights streamed from host memory
(docs/weight-streaming.md): the 70B shapes on one H200, or 8B under a 12 GB cap.

The recipe: bf16 weights, activation checkpointing (non-reentrant), the loss over vocabulary slices
(``use_chunked_loss``), AdamW wrapped with a ``bf16w-*`` preset and ``stream_weights=True`` (the
``-stream`` suffix; gradient release comes with it: each layer is updated in backward while it is
on the GPU, then written back). The decoder layers are built (``--shape``) or loaded (``--model``)
one at a time and moved to pinned host memory before the next, so the model is never whole on the
GPU, the HF Trainer's move to the GPU included. The optimizer state stays on the GPU up to
``--gpu-budget``, the rest in host memory (none: as the preset says: ``bf16w-4bit-lean`` keeps it all
on the GPU, too much at 70B; ``bf16w-4bit-lean-offload`` keeps it all in host memory). ``--gpu-memory
24GB`` caps this process (``set_per_process_memory_fraction`` before the build; GB = 1e9 bytes).

    # Llama-3-70B shapes on one H200, 95 GiB of state on the GPU (host: ~190 GiB RSS)
    PYTHONPATH=.:integrations python examples/finetune_70b_one_gpu.py --shape 70b --gpu-budget 95GiB --seq 4096
    # 70B under a 24 GB cap: all state and the layer inputs in host memory (needs ~270 GiB of host memory)
    PYTHONPATH=.:integrations python examples/finetune_70b_one_gpu.py --shape 70b --gpu-memory 24GB \\
        --preset bf16w-4bit-lean-offload --offload-activations
    # 8B under a 12 GB cap
    PYTHONPATH=.:integrations python examples/finetune_70b_one_gpu.py --shape 8b --gpu-memory 12GB \\
        --preset bf16w-4bit-lean-offload --micro-batch 4 --seq 2048
    # a Hugging Face checkpoint directory (config.json + *.safetensors), loaded layer by layer
    PYTHONPATH=.:integrations python examples/finetune_70b_one_gpu.py --model /path/to/Meta-Llama-3-70B \\
        --gpu-budget 95GiB --seq 4096
    # the same through the Hugging Face Trainer
    PYTHONPATH=.:integrations python examples/finetune_70b_one_gpu.py --trainer hf --shape 70b \\
        --gpu-budget 95GiB --seq 4096
    # CPU smoke run (what the tests do)
    PYTHONPATH=.:integrations python examples/finetune_70b_one_gpu.py --shape tiny --seq 32 --steps 3 --micro-batch 2

Each run prints one markdown table row; ``--json FILE`` appends it as a JSON line. s/step is the wall
clock over the steps after the first 2 (the device synchronised at both ends of that window), the
GPU peak ``torch.cuda.max_memory_allocated`` over the whole run (the build included; CUDA only),
the host memory the process's RSS (now and its peak), the pinned weights the streamed layers' host
copies, and the state on the GPU and in host memory ``opt.memory_report()``'s.

Data: nothing is downloaded. One batch of random token ids (seeded) is trained on every step, so
the loss falls as the model memorises it; the timing is that of any data of this shape. No
gradient clipping: with streaming a step spans several release batches, so clipping would be per
tensor rather than by the global norm (docs/weight-streaming.md, Limits).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

# before torch allocates: pinned memory from registered malloc'ed pages (fast to get), expandable segments
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True,pinned_use_cuda_host_register:True,"
                                                 "pinned_num_register_threads:8")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "0")  # one GPU (the HF Trainer would use DataParallel over several)

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "integrations")]  # run from a checkout
CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")

SHAPES = ("tiny", "0.95b", "3b", "8b", "70b", "405b")
PRESETS = ("bf16w-4bit-lean", "bf16w-4bit-lean-offload", "bf16w-4bit-lean-hostcorr", "bf16w-4bit",
           "bf16w-8bit-lean", "bf16w-8bit-lean-offload", "bf16w-8bit-lean-hostcorr", "bf16w-8bit")


def parse_args(argv=None) -> argparse.Namespace:
    from optstate_core.apps.llama import NAMED_SHAPES
    from optstate_core.state.units import parse_bytes

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="8b", choices=SHAPES, help="a Llama shape built with random weights")
    p.add_argument("--model", default=None, help="a local Hugging Face checkpoint directory (instead of --shape)")
    p.add_argument("--trainer", default="plain", choices=("plain", "hf"),
                   help="plain: a PyTorch loop; hf: the Hugging Face Trainer")
    p.add_argument("--preset", default="bf16w-4bit-lean", choices=PRESETS,
                   help="optstate preset (a bf16w-* one: the weights are bf16), streamed ('-stream')")
    p.add_argument("--gpu-budget", default=None,
                   help="optimizer state kept on the GPU, e.g. 95GiB; the rest in host memory")
    p.add_argument("--gpu-memory", default=None, help="cap this process's GPU memory, e.g. 24GB")
    p.add_argument("--offload-activations", action="store_true",
                   help="the layer inputs activation checkpointing keeps go to host memory")
    p.add_argument("--resident-layers", type=int, default=0,
                   help="the last N decoder layers stay on the GPU (not streamed)")
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--steps", type=int, default=6, help="at least 3: s/step is timed over the steps after 2")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="append the result as a JSON line to this file")
    args = p.parse_args(argv)
    for name in ("micro_batch", "seq"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.steps < 3:
        p.error(f"--steps must be >= 3 (s/step is timed over the steps after the first 2), got {args.steps}")
    if not args.lr > 0 or not math.isfinite(args.lr):
        p.error(f"--lr must be a positive number, got {args.lr}")
    for flag, value in (("--gpu-memory", args.gpu_memory), ("--gpu-budget", args.gpu_budget)):
        try:
            setattr(args, flag[2:].replace("-", "_") + "_bytes", value and parse_bytes(value, flag))
        except ValueError as e:
            p.error(str(e))
    if args.model is not None and not (Path(args.model) / "config.json").is_file():
        p.error(f"--model must be a local checkpoint directory with a config.json, got {args.model!r}")
    layers = (json.loads((Path(args.model) / "config.json").read_text())["num_hidden_layers"] if args.model
              else NAMED_SHAPES[args.shape].layers)
    if not 0 <= args.resident_layers < layers:
        p.error(f"--resident-layers must be in [0, {layers}) (the model has {layers} decoder layers; "
                f"at least one streams), got {args.resident_layers}")
    return args


def build(args):
    """The model with its decoder layers in host memory (never whole on the GPU), checkpointing on,
    the chunked loss; bf16 (on the CPU too: the bf16w-* presets run there)."""
    from optstate_core.apps.chunked_loss import use_chunked_loss
    from optstate_core.apps.llama import NAMED_SHAPES, build_model, load_streamed

    if args.model is not None:
        model = load_streamed(args.model, DEVICE, torch.bfloat16, checkpointing=True)
    else:
        model = build_model(NAMED_SHAPES[args.shape], DEVICE, torch.bfloat16, checkpointing=True, seed=args.seed,
                            stream=True)
    model.config.use_cache = False
    return use_chunked_loss(model)


def batch(args, vocab: int) -> torch.Tensor:
    """The one batch of random token ids every step sees."""
    g = torch.Generator().manual_seed(args.seed)
    return torch.randint(0, min(vocab, 32000), (args.micro_batch, args.seq), generator=g)


def start_stream(model, opt, resident: int):
    """Stream every decoder layer but the last ``resident``, which come back to the GPU to stay."""
    layers = list(model.model.layers)
    if resident:
        opt.stream_weights(model, layers=layers[-resident:]).close()  # home -> the GPU, for good
    return opt.stream_weights(model, layers=layers[:len(layers) - resident])


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


class Timer:
    """Wall clock over the steps after the first 2, the device synchronised at the window's ends only."""

    def __init__(self, steps: int):
        self.steps, self.done, self.t0, self.step_s = steps, 0, None, None

    def begin(self) -> None:
        if self.done == 2:
            sync()
            self.t0 = time.perf_counter()

    def end(self) -> None:
        self.done += 1
        if self.done == self.steps:
            sync()
            self.step_s = (time.perf_counter() - self.t0) / (self.steps - 2)


def train_plain(args, model, timer: Timer):
    import optstate_core as oc

    opt = oc.wrap(torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0), args.preset + "-stream",
                  gpu_budget=args.gpu_budget_bytes, offload_activations=args.offload_activations)
    stream = start_stream(model, opt, args.resident_layers)
    ids = batch(args, model.config.vocab_size).to(DEVICE)
    losses = []
    for _ in range(args.steps):
        timer.begin()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()  # each layer updated in backward (gradient release), written back, freed
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
        timer.end()
    return opt, stream, [float(x) for x in losses]


def train_hf(args, model, timer: Timer):
    import optstate_core as oc
    import optstate_hf  # noqa: F401  (registers the optstate_adamw_* optim names)
    from transformers import Trainer, TrainerCallback, TrainingArguments
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    losses = []

    class Measure(TrainerCallback):
        """Starts the stream before OptStateCallback would (which then takes it over), so that
        --resident-layers applies; times the steps; keeps the logged losses."""
        stream = None

        def on_train_begin(self, a, state, control, model=None, optimizer=None, **kw):
            self.stream = start_stream(model, oc.unwrap(optimizer), args.resident_layers)

        def on_step_begin(self, *a, **kw):
            timer.begin()

        def on_step_end(self, *a, **kw):
            timer.end()

        def on_log(self, a, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                losses.append(float(logs["loss"]))

    class InOrder(Trainer):  # the rows in order: every step sees the plain loop's batch
        def _get_train_sampler(self, *unused, **unused_kw):
            return torch.utils.data.SequentialSampler(self.train_dataset)

    optim_args = [f"gpu_budget={args.gpu_budget}"] if args.gpu_budget else []
    optim_args += ["offload_activations=true"] if args.offload_activations else []
    targs = TrainingArguments(
        output_dir=os.environ.get("FINETUNE_OUT", "/tmp/finetune_70b_one_gpu"),
        optim="optstate_adamw_" + args.preset.replace("-", "_") + "_stream", optim_args=",".join(optim_args) or None,
        learning_rate=args.lr, weight_decay=0.0, lr_scheduler_type="constant", max_grad_norm=0.0,
        gradient_checkpointing=False,  # the model checkpoints already (non-reentrant)
        bf16=False,  # the weights are bf16 already; bf16=True would add autocast (and differ from the plain loop)
        max_steps=args.steps, per_device_train_batch_size=args.micro_batch, logging_steps=1, report_to="none",
        save_strategy="no", disable_tqdm=True, seed=args.seed, use_cpu=not CUDA,
        dataloader_num_workers=0)
    rows = [{"input_ids": r, "labels": r} for r in batch(args, model.config.vocab_size)] * args.steps
    measure = Measure()
    # the layers are in host memory already (their GPU storage freed): the Trainer's move to the GPU copies nothing
    trainer = InOrder(model=model, args=targs, train_dataset=rows, callbacks=[measure])
    trainer.train()
    return oc.unwrap(trainer.optimizer), measure.stream, losses


def host_memory() -> tuple:
    """The process's RSS now and at its peak, GiB (Linux)."""
    with open("/proc/self/status") as f:
        kb = {line.split(":")[0]: int(line.split()[1]) for line in f if line.startswith(("VmRSS", "VmHWM"))}
    return kb["VmRSS"] / 2**20, kb["VmHWM"] / 2**20


def run(args) -> dict:
    if args.gpu_memory_bytes and CUDA:  # from the start: the build runs under it too
        torch.cuda.set_per_process_memory_fraction(
            min(1.0, args.gpu_memory_bytes / torch.cuda.get_device_properties(0).total_memory))
    started = time.perf_counter()
    model = build(args)
    build_s = time.perf_counter() - started
    timer = Timer(args.steps)
    opt, stream, losses = (train_plain if args.trainer == "plain" else train_hf)(args, model, timer)
    report, (rss, rss_peak) = opt.memory_report(), host_memory()
    return {"trainer": args.trainer, "model": args.model or args.shape, "preset": args.preset,
            "micro_batch": args.micro_batch, "seq": args.seq, "gpu_memory": args.gpu_memory,
            "gpu_budget": args.gpu_budget, "offload_activations": args.offload_activations,
            "resident_layers": args.resident_layers, "device": torch.cuda.get_device_name(0) if CUDA else "cpu",
            "steps": args.steps, "build_s": build_s, "step_s": timer.step_s,
            "tokens_per_s": args.micro_batch * args.seq / timer.step_s,
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if CUDA else None,
            "rss_gib": rss, "rss_peak_gib": rss_peak, "weights_pinned_bytes": stream.host_bytes(),
            "weights_h2d_bytes": stream.h2d_bytes, "weights_d2h_bytes": stream.d2h_bytes,
            "activations_d2h_bytes": stream.activations.d2h_bytes if stream.activations else None,
            "state_gpu_bytes": report["device_bytes"], "state_host_bytes": report["host_bytes"],
            "losses": losses}


TABLE_HEAD = ("| trainer | model | preset | micro-batch x seq | cap | s/step | tokens/s | GPU peak GiB | "
              "host RSS GiB | weights pinned GiB | state GPU / host GiB | first loss | last loss |\n"
              "|---|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")


def table_row(r: dict) -> str:
    extras = [f"gpu_budget={r['gpu_budget']}" if r["gpu_budget"] else "",
              "offload_activations" if r["offload_activations"] else "",
              f"{r['resident_layers']} layers resident" if r["resident_layers"] else ""]
    preset = " + ".join([r["preset"]] + [e for e in extras if e])
    peak = "-" if r["peak_gib"] is None else f"{r['peak_gib']:.2f}"
    return (f"| {r['trainer']} | {r['model']} | {preset} | {r['micro_batch']} x {r['seq']} | "
            f"{r['gpu_memory'] or '-'} | {r['step_s']:.3f} | {r['tokens_per_s']:.0f} | {peak} | "
            f"{r['rss_gib']:.1f} | {r['weights_pinned_bytes'] / 2**30:.2f} | "
            f"{r['state_gpu_bytes'] / 2**30:.2f} / {r['state_host_bytes'] / 2**30:.2f} | "
            f"{r['losses'][0]:.4f} | {r['losses'][-1]:.4f} |")


def main(argv=None) -> dict:
    args = parse_args(argv)
    row = run(args)
    print(TABLE_HEAD)
    print(table_row(row), flush=True)
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(row) + "\n")
    return row


if __name__ == "__main__":
    main()
