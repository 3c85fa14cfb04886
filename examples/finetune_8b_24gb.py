#!/usr/bin/env python3
"""Fully fine-tune Llama-3-8B with exact AdamW on one 24 GB card: the HF Trainer, Lightning or
Accelerate, and the same run with the peers (plain AdamW, torchao's CPUOffloadOptimizer,
DeepSpeed ZeRO-2 with CPU offload), timed and measured the same way.

The recipe: bf16 weights, activation checkpointing, the loss over vocabulary slices
(``use_chunked_loss``: the 128256-word logits never whole), gradient release (each gradient is
applied in backward and freed), and the optimizer state that ``python -m optstate_core plan``
picks for the cap and micro-batch (``--preset plan``, the default): the fp32 master weights
(bf16 + an 8-bit correction) and the 4-bit moments (``bf16w-4bit-lean``) stay on the GPU up to
a ``gpu_budget`` of what the weights, a bucket of gradients and the activations leave, and the
rest lives in pinned host memory and streams through the GPU each step (all of it,
``bf16w-4bit-lean-offload``, where no budget fits). ``--gpu-memory 24GB`` caps this process at 24e9 bytes of an 80 GB card
(``torch.cuda.set_per_process_memory_fraction``), so an allocation past it fails as on a 24 GB card.

    # the 24 GB recipe (HF Trainer; an 8B-shaped model built in seconds on the GPU, random weights)
    PYTHONPATH=.:integrations python examples/finetune_8b_24gb.py --gpu-memory 24GB
    # a real checkpoint (a local directory in Hugging Face format)
    PYTHONPATH=.:integrations python examples/finetune_8b_24gb.py --model /path/to/Meta-Llama-3-8B --gpu-memory 24GB
    # the same through Lightning or Accelerate
    PYTHONPATH=.:integrations python examples/finetune_8b_24gb.py --framework lightning --gpu-memory 24GB
    PYTHONPATH=.:integrations python examples/finetune_8b_24gb.py --framework accelerate --gpu-memory 24GB
    # a preset of your choice: all state streamed; resident state up to 2 GiB, the rest streamed
    PYTHONPATH=.:integrations python examples/finetune_8b_24gb.py --preset bf16w-4bit-lean-offload --gpu-memory 24GB
    PYTHONPATH=.:integrations python examples/finetune_8b_24gb.py --gpu-budget 2GiB --gpu-memory 24GB
    # the largest micro-batch under the cap
    PYTHONPATH=.:integrations python examples/finetune_8b_24gb.py --gpu-memory 24GB --find-micro-batch
    # the peers (same model, data, loss and measurement)
    PYTHONPATH=.:integrations python examples/finetune_8b_24gb.py --optimizer adamw            # needs ~16 B/param
    PYTHONPATH=.:integrations python examples/finetune_8b_24gb.py --optimizer torchao-offload --gpu-memory 24GB
    PYTHONPATH=.:integrations python examples/finetune_8b_24gb.py --optimizer deepspeed-offload --gpu-memory 24GB
    # the recipe against resident state on the whole card, 5 runs each, interleaved in one process
    PYTHONPATH=.:integrations python examples/finetune_8b_24gb.py --gpu-memory 24GB --against-resident --repeats 5
    # repeated runs and resumes that match bit for bit (deterministic attention backward)
    PYTHONPATH=.:integrations python examples/finetune_8b_24gb.py --gpu-memory 24GB --deterministic
    # CPU smoke run (what the tests do)
    PYTHONPATH=.:integrations python examples/finetune_8b_24gb.py --shape tiny --seq 32 --steps 3 --micro-batch 2

Each run prints one markdown table row (framework, optimizer, preset, micro-batch, cap, first
step s, s/step: the mean over the steps after the first 2, timed as one window synchronised at its ends
(as a training loop runs; Python's garbage collector has the setup's objects frozen from the first
step on, ``gc.freeze()``, as a long run amortises them: one full collection of them took 0.3 s, which
in a window of a few steps read as a 10% slower step), tokens/s, peak GiB from ``torch.cuda.max_memory_allocated`` (the JSON adds
the peak of the steps after the first alone: under FSDP2 the whole peak includes building the
model on every GPU before it is sharded),
first and last loss); ``--json PATH`` appends the same fields as a JSON line (and the pinned host
memory the run asked for, with the seconds the training thread spent pinning or waiting for it: the
state is pinned on a thread from wrap() on, see ``optstate_core/schedule/pin_ahead.py``). ``--repeats N`` runs N times in one process;
``--against-resident`` alternates each run with the resident baseline on the whole card and prints
both medians and their ratio (the JSON gets a last ``"role": "summary"`` line). The process's first
run starts cuBLAS and attention on a thread while it builds the model (on a fresh machine the first
attention backward alone takes 2.3 s; ``optstate_core/apps/warm_start.py``, ``--no-warm-start``: not);
its JSON has ``since_start_s``, the seconds from the script's start to the first step's end.

Several GPUs (``torchrun --nproc-per-node N`` or ``accelerate launch``; WORLD_SIZE > 1): the
Trainer gets ``fsdp="full_shard", fsdp_config={"version": 2, "reshard_after_forward": True,
"activation_checkpointing": False}`` (as tests/integrations/hf_fsdp2_worker.py, which ran on GPUs; checkpointing is
the model's own), Accelerate a ``FullyShardedDataParallelPlugin(fsdp_version=2,
reshard_after_forward=True, activation_checkpointing=False)``. Lightning stays single-device here.

Data: nothing is downloaded. One global batch of fixed random token sequences (a fixed generator,
tokens from the first 2048 ids) is seen at every step, in order, so the loss falls visibly within a
few steps; the timing is that of any data of this shape.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

STARTED = time.perf_counter()  # the script's start: the JSON's ``since_start_s`` counts from here

# Before torch allocates anything (unless the caller set it): pinned host memory from malloc'ed pages
# touched by 8 threads and then registered, ~5x faster to get than cudaHostAlloc (16 GiB in 2.4 s
# against 13.2 s on an H100 host: all offloaded state is pinned in the first step); expandable segments,
# so the activations of a larger micro-batch fit the cap without fragmentation (docs/benchmarks-journal.md section 28).
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True,pinned_use_cuda_host_register:True,"
                                                 "pinned_num_register_threads:8")
# A one-GPU recipe unless launched with torchrun: run as a plain process on a machine with several
# GPUs, the HF Trainer would replicate the model over all of them with nn.DataParallel (which the
# chunked loss and gradient release do not support); so it sees the first GPU only (unless the caller
# chose the GPUs).
if "WORLD_SIZE" not in os.environ:
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "0")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integrations"))
from optstate_core.state.pinned import pinning_totals  # noqa: E402
from optstate_core.step.kernels import compile_ahead  # noqa: E402

FRAMEWORKS = ("trainer", "lightning", "accelerate")
OPTIMIZERS = ("optstate", "adamw", "torchao-offload", "deepspeed-offload")
SHAPES = ("8b", "70b", "0.95b", "tiny")
BETAS, EPS = (0.9, 0.999), 1e-8
MAX_GRAD_NORM = 1.0
RESIDENT_PRESET = "bf16w-4bit-lean"  # --against-resident's baseline: all state on the GPU
OFFLOAD_PRESET = "bf16w-4bit-lean-offload"  # all state in host memory
PLAN = "plan"  # --preset: as optstate plan picks (resolve_plan)


# -- arguments ------------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    from optstate_core.presets import PRESET_ALIASES, PRESETS
    from optstate_core.state.units import parse_bytes

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--framework", default="trainer", choices=FRAMEWORKS)
    p.add_argument("--optimizer", default="optstate", choices=OPTIMIZERS)
    p.add_argument("--preset", default=PLAN,
                   help="optstate preset of --optimizer optstate (a bf16w-* preset: the model's weights are bf16); "
                        f"'{PLAN}' (default): what `python -m optstate_core plan` picks for this model, cap and "
                        "micro-batch (bf16w-4bit-lean, with a gpu_budget of what the activations leave where "
                        "state must stream; bf16w-4bit-lean-offload where no budget fits; the offload preset on "
                        "the CPU and under several processes)")
    p.add_argument("--model", default=None, help="a local Hugging Face checkpoint directory (overrides --shape)")
    p.add_argument("--shape", default="8b", choices=SHAPES, help="a Llama shape built with random weights")
    p.add_argument("--gpu-budget", default=None, help="optimizer state kept on the GPU, e.g. 2GiB (optstate)")
    p.add_argument("--gpu-memory", default=None,
                   help="cap this process's GPU memory, e.g. 24GB (GB = 1e9 bytes, GiB = 2**30)")
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plain-loss", action="store_true", help="the model's own loss (whole logits)")
    p.add_argument("--find-micro-batch", action="store_true",
                   help="try micro-batches 1, 2, 4, ... (2 steps each) and report the largest that runs")
    p.add_argument("--max-micro-batch", type=int, default=256, help="where --find-micro-batch stops")
    p.add_argument("--repeats", type=int, default=1,
                   help="run the configuration this many times in this process (the model rebuilt each time)")
    p.add_argument("--against-resident", action="store_true",
                   help="alternate each run with the resident baseline: the same framework, batch and steps with "
                        f"{RESIDENT_PRESET} + release on the whole card (no cap, no budget); prints the ratio of "
                        "the median s/step")
    p.add_argument("--deterministic", action="store_true",
                   help="torch.use_deterministic_algorithms(True) with CUBLAS_WORKSPACE_CONFIG=:4096:8: repeated "
                        "runs and resumes match bit for bit (attention's default backward adds dQ in an order that "
                        "varies; BENCHMARKS.md 37)")
    p.add_argument("--no-warm-start", dest="warm_start", action="store_false",
                   help="do not start cuBLAS and attention on a thread while the model is built (by default "
                        "the process's first run does: optstate_core/apps/warm_start.py)")
    p.add_argument("--json", default=None, help="append the result as a JSON line to this file")
    p.add_argument("--profile-trace", default=None, metavar="PATH",
                   help="write a torch.profiler chrome trace of the two steps after the warm-up here (ranges "
                        "'step' and 'forward'; summarise with tools/trace_timeline.py)")
    args = p.parse_args(argv)
    for name in ("micro_batch", "seq", "steps", "max_micro_batch", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not args.lr > 0 or not math.isfinite(args.lr):
        p.error(f"--lr must be a positive number, got {args.lr}")
    if args.weight_decay < 0:
        p.error(f"--weight-decay must be >= 0, got {args.weight_decay}")
    if args.find_micro_batch and (args.repeats > 1 or args.against_resident):
        p.error("--find-micro-batch takes neither --repeats nor --against-resident")
    if args.optimizer == "deepspeed-offload" and args.framework != "trainer":
        p.error(f"--optimizer deepspeed-offload runs through --framework trainer only, not {args.framework}")
    args.preset = PRESET_ALIASES.get(args.preset, args.preset)
    if args.optimizer == "optstate" and args.preset not in PRESETS and args.preset != PLAN:
        p.error(f"--preset must be '{PLAN}' or one of {', '.join(sorted(PRESETS))}, got {args.preset!r}")
    if args.gpu_budget is not None and args.optimizer != "optstate":
        p.error("--gpu-budget applies to --optimizer optstate only")
    for flag, attr in (("--gpu-memory", "gpu_memory"), ("--gpu-budget", "gpu_budget")):
        value = getattr(args, attr)
        if value is not None:
            try:
                setattr(args, attr + "_bytes", parse_bytes(value, flag))
            except ValueError as e:
                p.error(str(e))
        else:
            setattr(args, attr + "_bytes", None)
    if args.model is not None and not Path(args.model).is_dir():
        p.error(f"--model must be a local checkpoint directory, got {args.model!r}")
    return args


def resolve_plan(args) -> argparse.Namespace:
    """``--preset plan``: the preset and ``gpu_budget`` that ``optstate plan`` picks for this model,
    cap (the whole card without one) and micro-batch (:func:`optstate_core.apps.recipe.preset_for`:
    of the presets that fit, the one that moves the fewest bytes over PCIe per step). An explicit
    ``--gpu-budget`` keeps state resident up to it with bf16w-4bit-lean. On the CPU (no GPU memory
    to plan) and under several processes (the plan is for one GPU): the offload preset. Returns
    ``args`` resolved (a copy; as given for any other preset)."""
    if args.optimizer != "optstate" or args.preset != PLAN:
        return args
    args = argparse.Namespace(**vars(args))
    if args.gpu_budget is not None:
        args.preset = RESIDENT_PRESET
        return args
    cap = args.gpu_memory_bytes
    if cap is None and torch.cuda.is_available():
        cap = torch.cuda.get_device_properties(device()).total_memory
    if cap is None or world_size() > 1:
        args.preset = OFFLOAD_PRESET
        return args
    from optstate_core.apps.llama import NAMED_SHAPES
    from optstate_core.apps.model_shapes import load_config
    from optstate_core.apps.recipe import preset_for
    config = load_config(str(Path(args.model) / "config.json")) if args.model else NAMED_SHAPES[args.shape].hf_config()
    preset, budget = preset_for(config, cap, args.micro_batch, args.seq, fused_loss=not args.plain_loss)
    if preset is None:
        sys.exit(f"--preset {PLAN}: no preset fits {args.model or args.shape} at micro-batch {args.micro_batch} x "
                 f"{args.seq} in {cap / 2**30:.2f} GiB; see python -m optstate_core plan --help (a smaller "
                 "micro-batch, or several GPUs)")
    args.preset = preset
    if budget is not None:
        args.gpu_budget, args.gpu_budget_bytes = f"{budget / 2**30:.2f}GiB", budget
    print(f"--preset {PLAN}: {args.preset}" + (f" + gpu_budget={args.gpu_budget}" if budget else "") +
          f" (micro-batch {args.micro_batch} x {args.seq}, {cap / 2**30:.2f} GiB)")
    return args


# -- device, model, data --------------------------------------------------------------------------
def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def device() -> torch.device:
    if not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))


def cap_gpu_memory(cap_bytes, whole_card_if_none: bool = False) -> None:
    """Cap this process's allocations at ``cap_bytes`` (before anything is allocated); with
    ``whole_card_if_none``, lift an earlier cap when ``cap_bytes`` is None."""
    if (cap_bytes is None and not whole_card_if_none) or not torch.cuda.is_available():
        return
    dev = device()
    total = torch.cuda.get_device_properties(dev).total_memory
    torch.cuda.set_per_process_memory_fraction(1.0 if cap_bytes is None else min(1.0, cap_bytes / total), dev)


def load_model(args):
    """bf16 weights on the device, activation checkpointing, the chunked loss."""
    from optstate_core.apps.llama import NAMED_SHAPES, build_model, enable_checkpointing
    from optstate_core.apps.chunked_loss import use_chunked_loss

    dev = device()
    if args.model is not None:
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16, device_map={"": dev})
        model.config.use_cache = False
        enable_checkpointing(model)
        model.train()
    else:
        model = build_model(NAMED_SHAPES[args.shape], dev, torch.bfloat16, checkpointing=True, seed=args.seed)
    if not args.plain_loss:
        use_chunked_loss(model)
    if args.profile_trace:
        mark_forward(model)
    return model


def mark_forward(model) -> None:
    """A profiler range "forward" around each call of the whole model (recomputation under
    checkpointing runs the layers alone, inside backward)."""
    from torch.profiler import record_function
    ranges = []
    model.register_forward_pre_hook(lambda *_: ranges.append(record_function("forward").__enter__()))
    model.register_forward_hook(lambda *_: ranges.pop().__exit__(None, None, None) if ranges else None)


class RepeatedSequences(torch.utils.data.Dataset):
    """``n`` rows cycling through ``distinct`` fixed random sequences: {input_ids, labels}. With
    ``distinct`` = the global batch and sequential order, every step sees the same sequences, so
    the loss of consecutive steps is comparable and falls."""

    def __init__(self, n: int, distinct: int, seq: int, vocab: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.rows = torch.randint(0, min(vocab, 2048), (distinct, seq), generator=g)
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        ids = self.rows[i % len(self.rows)]
        return {"input_ids": ids, "labels": ids.clone()}


def dataset(args, model) -> RepeatedSequences:
    batch = args.micro_batch * world_size()
    return RepeatedSequences(args.steps * batch, batch, args.seq, model.config.vocab_size, args.seed)


# -- optimizers -------------------------------------------------------------------------------------
def base_adamw(params, args, fused=None):
    return torch.optim.AdamW(params, lr=args.lr, betas=BETAS, eps=EPS, weight_decay=args.weight_decay, fused=fused)


def build_optimizer(args, model):
    """The optimizer object for Lightning / Accelerate / the Trainer's peers."""
    params = [p for p in model.parameters() if p.requires_grad]
    cuda = params[0].is_cuda
    if args.optimizer == "adamw":
        return base_adamw(params, args, fused=cuda or None)
    if args.optimizer == "torchao-offload":
        from torchao.optim import CPUOffloadOptimizer
        return CPUOffloadOptimizer(params, torch.optim.AdamW, offload_gradients=True, lr=args.lr, betas=BETAS,
                                   eps=EPS, weight_decay=args.weight_decay, fused=True)
    import optstate_core as oc
    names = {"named_parameters": list(model.named_parameters())} if world_size() == 1 else {}  # FSDP2 swaps them
    return oc.wrap(base_adamw(params, args, fused=cuda or None), args.preset, release_gradients=True,
                   max_grad_norm=MAX_GRAD_NORM, gpu_budget=args.gpu_budget_bytes, **names)


def clips_itself(args) -> bool:
    """Whether the framework's own gradient clipping applies: not for optstate (release: the
    optimizer clips) nor torchao with offload_gradients (no gradient stays on the parameters)."""
    return args.optimizer in ("adamw", "deepspeed-offload")


# -- timing ---------------------------------------------------------------------------------------------
ALLOCATOR_COUNTS = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams")


def allocator_counts() -> dict:
    """The CUDA caching allocator's event counters (a retry frees cached blocks after a synchronisation)."""
    if not torch.cuda.is_available():
        return {}
    stats = torch.cuda.memory_stats(device())
    return {k: stats.get(k, 0) for k in ALLOCATOR_COUNTS}


class StepTimer:
    """Wall time as a training loop sees it: the first step synchronised at both ends; then steps
    ``warmup + 1`` to the last as one window, CUDA synchronised only at its two ends (a step's copies
    to and from host memory may run on into the next step's forward, as they do in training); the
    window's mean per step is the step time."""

    def __init__(self, steps: int, warmup: int = 2, trace: str = None):
        self.steps = steps
        self.trace = trace  # a chrome trace of the two steps after the warm-up goes here
        self._profiler, self._range = None, None
        self.warmup = max(0, min(warmup, steps - 1))  # steps before the window (the first among them)
        self.first_s = None
        self.first_end = None  # host clock at the first step's (synchronised) end
        self.window_s = None  # mean seconds per step over the window
        self.first_peak = None  # CUDA: bytes at the peak of model setup and the first step
        self.losses = []
        self.starts = []  # host clock at each step's begin (steps after the first are not synchronised)
        self.window_allocator = {}  # CUDA caching allocator events inside the window (retries, cudaMalloc/Free)
        self._i, self._t0, self._window_t0, self._allocator0 = 0, None, None, {}

    @staticmethod
    def _sync():
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def begin(self):
        if self._i == 0:  # the setup's objects (model, framework) frozen: a full GC pass (0.3 s) skips them
            gc.collect()
            gc.freeze()
        if self._i in (0, self.warmup):
            self._sync()
        self._t0 = time.perf_counter()
        self.starts.append(self._t0)
        if self._i == self.warmup:
            self._window_t0 = self._t0
            self._allocator0 = allocator_counts()
        self._profile_begin()

    def end(self, loss=None):
        last = self._i == self.steps - 1
        if self._i == 0 or last:
            self._sync()
        now = time.perf_counter()
        self._profile_end()
        if self._i == 0:
            self.first_s, self.first_end = now - self._t0, now
            if torch.cuda.is_available():  # the peak of setup and the first step; later steps measured apart
                self.first_peak = torch.cuda.max_memory_allocated()
                torch.cuda.reset_peak_memory_stats()
        if last:
            self.window_s = (now - self._window_t0) / (self._i - self.warmup + 1)
            self.window_allocator = {k: v - self._allocator0.get(k, 0) for k, v in allocator_counts().items()}
            self.starts.append(now)
        self._i += 1
        if loss is not None:
            self.losses.append(float(loss))

    @property
    def count(self) -> int:
        return self._i

    def _profile_begin(self):
        """With a trace path: start the profiler at the first step after the warm-up, open a range per step."""
        if not self.trace or not self.warmup < self._i <= self.warmup + 2:
            return
        from torch.profiler import ProfilerActivity, profile, record_function
        if self._profiler is None:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            self._profiler = profile(activities=activities)
            self._profiler.__enter__()
        self._range = record_function("step")
        self._range.__enter__()

    def _profile_end(self):
        """Close the step's range; after the second profiled step (or the last), write the trace."""
        if self._range is None:
            return
        self._sync()
        self._range.__exit__(None, None, None)
        self._range = None
        if self._i == self.warmup + 2 or self._i == self.steps - 1:
            self._profiler.__exit__(None, None, None)
            self._profiler.export_chrome_trace(self.trace)
            self._profiler = None


# -- the three frameworks ----------------------------------------------------------------------------
def run_trainer(args, timer: StepTimer):
    import optstate_hf
    from transformers import Trainer, TrainerCallback, TrainingArguments
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    model = load_model(args)

    class Timing(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            timer.begin()

        def on_step_end(self, a, state, control, **kw):
            timer.end()

        def on_log(self, a, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                timer.losses.append(float(logs["loss"]))

    kwargs = dict(output_dir=os.environ.get("FINETUNE_OUT", "/tmp/finetune_8b_24gb"), max_steps=args.steps,
                  per_device_train_batch_size=args.micro_batch, learning_rate=args.lr,
                  weight_decay=args.weight_decay, adam_beta1=BETAS[0], adam_beta2=BETAS[1], adam_epsilon=EPS,
                  lr_scheduler_type="constant", max_grad_norm=MAX_GRAD_NORM if clips_itself(args) else 0.0,
                  logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True, seed=args.seed,
                  use_cpu=not torch.cuda.is_available(), dataloader_num_workers=0)
    trainer_cls = Trainer
    if "train_sampling_strategy" in {f.name for f in dataclasses.fields(TrainingArguments)}:
        kwargs["train_sampling_strategy"] = "sequential"  # every step sees the same sequences
    else:  # transformers before the option: the same order through the sampler the Trainer asks for
        class SequentialTrainer(Trainer):
            def _get_train_sampler(self, *unused, **unused_kw):
                return torch.utils.data.SequentialSampler(self.train_dataset)
        trainer_cls = SequentialTrainer
    if world_size() > 1:
        kwargs.update(fsdp="full_shard", fsdp_config={"version": 2, "reshard_after_forward": True,
                                              "activation_checkpointing": False})
    trainer_kwargs, callbacks = {}, [Timing()]
    if args.optimizer == "optstate":
        optim_args = "release_gradients=true"
        if args.gpu_budget is not None:
            optim_args += f",gpu_budget={args.gpu_budget}"
        kwargs.update(optim_args=optim_args, max_grad_norm=MAX_GRAD_NORM)  # routed to the optimizer
        optim = "optstate_adamw_" + args.preset.replace("-", "_")
        if optim in optstate_hf.OPTIM_NAMES:
            kwargs["optim"] = optim
        else:  # a preset without a registered name: the same optimizer class, passed directly
            trainer_kwargs["optimizer_cls_and_kwargs"] = optstate_hf.optimizer_cls_and_kwargs(
                TrainingArguments(**kwargs), preset=args.preset)
        callbacks.append(optstate_hf.OptStateCallback(log_metrics=False))
    elif args.optimizer == "deepspeed-offload":
        kwargs.update(bf16=True, deepspeed={
            "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}},
            "bf16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "betas": list(BETAS), "eps": EPS,
                                                      "weight_decay": args.weight_decay}},
            "gradient_clipping": MAX_GRAD_NORM, "train_micro_batch_size_per_gpu": args.micro_batch,
            "gradient_accumulation_steps": 1})
    else:
        trainer_kwargs["optimizers"] = (build_optimizer(args, model), None)
    trainer = trainer_cls(model=model, args=TrainingArguments(**kwargs), train_dataset=dataset(args, model),
                      callbacks=callbacks, **trainer_kwargs)
    trainer.train()
    return model


def run_lightning(args, timer: StepTimer):
    import lightning.pytorch as L
    from optstate_lightning import OptStateCallback

    class CausalLM(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = load_model(args)

        def training_step(self, batch, batch_idx):
            return self.model(**batch).loss

        def configure_optimizers(self):
            if args.optimizer == "optstate":
                return base_adamw(self.model.parameters(), args, fused=self.device.type == "cuda" or None)
            return build_optimizer(args, self.model)

    class Timing(L.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            timer.begin()

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            loss = outputs["loss"] if isinstance(outputs, dict) else outputs
            timer.end(loss.detach().float())

    callbacks = [Timing()]
    clip = MAX_GRAD_NORM if clips_itself(args) else None
    if args.optimizer == "optstate":
        # release_gradients: the callback hands gradient_clip_val to the optimizer (norm clipping in backward)
        callbacks.append(OptStateCallback(policy=args.preset, log_metrics=False, release_gradients=True,
                                          gpu_budget=args.gpu_budget_bytes))
        clip = MAX_GRAD_NORM
    module = CausalLM()
    loader = torch.utils.data.DataLoader(dataset(args, module.model), batch_size=args.micro_batch)
    trainer = L.Trainer(accelerator="gpu" if torch.cuda.is_available() else "cpu", devices=1,
                        precision="bf16-true", max_steps=args.steps, gradient_clip_val=clip, callbacks=callbacks,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(module, loader)
    return module.model


def run_accelerate(args, timer: StepTimer):
    from accelerate import Accelerator

    kwargs = {}
    if world_size() > 1:
        from accelerate.utils import FullyShardedDataParallelPlugin
        kwargs["fsdp_plugin"] = FullyShardedDataParallelPlugin(fsdp_version=2, reshard_after_forward=True,
                                                               activation_checkpointing=False)
    accelerator = Accelerator(mixed_precision="no", cpu=not torch.cuda.is_available(), **kwargs)
    model = load_model(args)
    optimizer = build_optimizer(args, model)
    loader = torch.utils.data.DataLoader(dataset(args, model), batch_size=args.micro_batch)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    if args.optimizer == "optstate":
        import optstate_accelerate as osa
        osa.attach(accelerator, optimizer)
    model.train()
    for batch in loader:
        timer.begin()
        loss = model(**batch).loss
        accelerator.backward(loss)
        if clips_itself(args):
            accelerator.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        timer.end(loss.detach().float())
    return model


RUNNERS = {"trainer": run_trainer, "lightning": run_lightning, "accelerate": run_accelerate}


# -- one measured run -------------------------------------------------------------------------------------
_PROCESS = {"runs": 0}  # this process's runs so far


def attention_shape(args):
    """``(heads, kv_heads, head_dim)`` of the model ``args`` name (a checkpoint's config or a shape)."""
    if args.model is not None:
        from optstate_core.apps.model_shapes import attention_shape as config_attention, load_config
        return config_attention(load_config(str(Path(args.model) / "config.json")))
    from optstate_core.apps.llama import NAMED_SHAPES
    shape = NAMED_SHAPES[args.shape]
    return shape.heads, shape.kv_heads, shape.hidden // shape.heads


def start_warm_start(args):
    """cuBLAS and attention started on a thread while the model is built (None: off, or not on CUDA)."""
    if not args.warm_start or not torch.cuda.is_available():
        return None
    from optstate_core.apps import warm_start
    return warm_start.start(device(), *attention_shape(args))


def measure(args) -> dict:
    """Train ``args.steps`` steps; the measured row (``--preset plan`` resolved for this run's micro-batch)."""
    args = resolve_plan(args)
    cuda = torch.cuda.is_available()
    if cuda:  # (the device made current and CUDA initialised first: a run without a cap has touched neither)
        torch.cuda.set_device(device())
        torch.cuda.init()
        torch.cuda.reset_peak_memory_stats(device())
    torch.manual_seed(args.seed)
    timer = StepTimer(args.steps, trace=args.profile_trace)
    first_run = _PROCESS["runs"] == 0
    warm = start_warm_start(args) if first_run else None
    _PROCESS["runs"] += 1
    pinned_bytes, pinned_s = pinning_totals()
    try:
        model = RUNNERS[args.framework](args, timer)
        del model
    finally:
        gc.unfreeze()  # the timer froze the setup's objects at the first step: collectable again
    pinned_bytes, pinned_s = (now - before for now, before in zip(pinning_totals(), (pinned_bytes, pinned_s)))
    losses, step_s = timer.losses, timer.window_s
    return {"framework": args.framework, "optimizer": args.optimizer,
            "preset": args.preset if args.optimizer == "optstate" else None,
            "model": args.model or args.shape, "micro_batch": args.micro_batch, "seq": args.seq,
            "gpu_memory": args.gpu_memory, "gpu_budget": args.gpu_budget, "world_size": world_size(),
            "device": torch.cuda.get_device_name(device()) if cuda else "cpu",
            "steps": timer.count, "first_step_s": timer.first_s, "step_s": step_s,
            "tokens_per_s": args.micro_batch * args.seq / step_s if step_s and step_s > 0 else None,
            "peak_gib": max(timer.first_peak or 0, torch.cuda.max_memory_allocated(device())) / 2**30 if cuda else None,
            "peak_after_first_step_gib": torch.cuda.max_memory_allocated(device()) / 2**30
            if cuda and timer.count > 1 else None,
            "loss_first": losses[0] if losses else None, "loss_last": losses[-1] if losses else None,
            "losses": losses, "pinned_gib": pinned_bytes / 2**30, "pinning_s": pinned_s,
            "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
            "deterministic": torch.are_deterministic_algorithms_enabled(),
            # host seconds from each step's begin to the next (the last: to the window's synchronised end)
            "step_host_s": [round(b - a, 4) for a, b in zip(timer.starts, timer.starts[1:])],
            "window_allocator": timer.window_allocator,
            "compiled_ahead": compile_ahead.stats(),  # this process's kernel compiles on the worker so far
            # from the script's start to the first step's end (the process's first run only)
            "since_start_s": timer.first_end - STARTED if first_run and timer.first_end is not None else None,
            "warm_start": warm.summary() if warm is not None else None}  # None: not this run, or not on CUDA


def table_row(r: dict) -> str:
    def num(x, fmt):
        return "-" if x is None else format(x, fmt)
    preset = (r["preset"] or "-") + (f" + gpu_budget={r['gpu_budget']}" if r.get("gpu_budget") else "")
    return (f"| {r['framework']} | {r['optimizer']} | {preset} | {r['micro_batch']} x {r['seq']} | "
            f"{r['gpu_memory'] or '-'} | {num(r['first_step_s'], '.2f')} | {num(r['step_s'], '.3f')} | "
            f"{num(r['tokens_per_s'], '.0f')} | {num(r['peak_gib'], '.2f')} | {num(r['loss_first'], '.4f')} | "
            f"{num(r['loss_last'], '.4f')} |")


TABLE_HEAD = ("| framework | optimizer | preset | micro-batch x seq | cap | first step s | s/step | "
              "tokens/s | peak GiB | first loss | last loss |\n|---|---|---|---|---|---|---|---|---|---|---|")


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def find_micro_batch(args) -> dict:
    """Micro-batches 1, 2, 4, ... for 2 steps each until one runs out of GPU memory."""
    best, mb = None, 1
    while mb <= args.max_micro_batch:
        trial = argparse.Namespace(**{**vars(args), "micro_batch": mb, "steps": 2})
        try:
            row = measure(trial)
        except torch.OutOfMemoryError:
            print(f"micro-batch {mb}: out of memory")
            break
        finally:
            free_memory()
        print(table_row(row))
        best, mb = row, mb * 2
    if best is None:
        return {"framework": args.framework, "optimizer": args.optimizer, "largest_micro_batch": 0}
    return {**best, "largest_micro_batch": best["micro_batch"]}


def resident_baseline(args) -> argparse.Namespace:
    """--against-resident's baseline: the same run with all state resident on the whole card."""
    return argparse.Namespace(**{**vars(args), "optimizer": "optstate", "preset": RESIDENT_PRESET, "gpu_budget": None,
                                 "gpu_budget_bytes": None, "gpu_memory": None, "gpu_memory_bytes": None})


def repeated_runs(args) -> list:
    """``--repeats`` runs in this process, each alternating with the resident baseline under
    --against-resident; the rows (``role``, ``run`` added) and, last, a summary row."""
    roles = [("recipe", args)] + ([("resident", resident_baseline(args))] if args.against_resident else [])
    rows = []
    for run in range(1, args.repeats + 1):
        for role, run_args in roles:
            cap_gpu_memory(run_args.gpu_memory_bytes, whole_card_if_none=True)
            try:
                row = measure(run_args)
            finally:
                free_memory()
            rows.append({**row, "role": role, "run": run})
            print(table_row(rows[-1]))
    medians = {role: [r["step_s"] for r in rows if r["role"] == role] for role, _ in roles}
    summary = {"role": "summary", "runs": args.repeats, "first_step_s": rows[0]["first_step_s"],
               "recipe_s": statistics.median(medians["recipe"]), "recipe_runs_s": medians["recipe"]}
    if args.against_resident:
        summary.update(resident_s=statistics.median(medians["resident"]), resident_runs_s=medians["resident"])
        summary["tokens_per_s_vs_resident"] = summary["resident_s"] / summary["recipe_s"]
    return rows + [summary]


def summary_line(summary: dict) -> str:
    runs = ", ".join(f"{x:.3f}" for x in summary["recipe_runs_s"])
    line = (f"recipe: median s/step {summary['recipe_s']:.3f} over {summary['runs']} runs ({runs}); "
            f"first step of the first run {summary['first_step_s']:.2f} s")
    if "resident_s" in summary:
        runs = ", ".join(f"{x:.3f}" for x in summary["resident_runs_s"])
        line += (f"\nresident ({RESIDENT_PRESET}, whole card): median s/step {summary['resident_s']:.3f} ({runs}); "
                 f"the recipe's tokens/s: {summary['tokens_per_s_vs_resident']:.3f}x resident")
    return line


def check_available(args) -> None:
    """Exit with a clear message when a peer's package is missing (before any model is built)."""
    module = {"torchao-offload": "torchao.optim", "deepspeed-offload": "deepspeed"}.get(args.optimizer)
    if module is None:
        return
    if not torch.cuda.is_available():
        sys.exit(f"--optimizer {args.optimizer} needs a CUDA device")
    try:
        __import__(module)
    except ImportError as e:
        sys.exit(f"--optimizer {args.optimizer} needs {module.split('.')[0]} "
                 f"(pip install {module.split('.')[0]}): {e}")


def make_deterministic() -> None:
    """``--deterministic``: deterministic kernels everywhere, before CUDA or cuBLAS start, without
    torch's fill of every new tensor (a check for reads of uninitialized memory, paid at each
    allocation; the 8B recipe's losses were the same bit for bit with and without it, docs/benchmarks-journal.md
    37, and tests/test_uninitialized_reads.py checks every preset's step for such reads). Not the
    Trainer's ``full_determinism=True``, which also sets ``CUDA_LAUNCH_BLOCKING=1`` (every launch
    waits for the GPU: slow) and is the Trainer's alone."""
    import torch.utils.deterministic

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = False


def main(argv=None) -> dict:
    args = parse_args(argv)
    check_available(args)
    if args.deterministic:
        make_deterministic()
    cap_gpu_memory(args.gpu_memory_bytes)  # before anything is allocated
    print(TABLE_HEAD)
    if args.find_micro_batch:
        results = [find_micro_batch(args)]
        print(f"largest micro-batch that ran 2 steps: {results[0]['largest_micro_batch']}")
    elif args.repeats > 1 or args.against_resident:
        results = repeated_runs(args)
        print(summary_line(results[-1]))
    else:
        results = [measure(args)]
        print(table_row(results[0]))
    if args.json and int(os.environ.get("RANK", "0")) == 0:
        with open(args.json, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in results)
    return results[-1]


if __name__ == "__main__":
    main()
