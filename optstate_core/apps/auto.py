"""Preset ``auto``: the preset, ``gpu_budget`` and gradient release for a model on its device, by ``optstate plan``'s arithmetic.

:func:`choose` reads the trained parameters (count, shapes, dtype), the device's memory and, when
known, the micro-batch and sequence length, then asks the planner: :func:`~.plan.make_plan` for the
rows and :func:`~.recipe.pick` for the choice (the rule of ``optstate plan``'s recipe and of
``examples/finetune_8b_24gb.py --preset plan``: of the candidates that fit, the one that moves the
fewest bytes over PCIe per step, then the earlier in the list). bf16 parameters take the recipe's
candidates (:data:`~.recipe.CANDIDATES`: fp32 masters as compressed state), fp32 and fp16 ones
:data:`PLAIN_CANDIDATES`. Activations are the planner's estimate for a Llama-family config
(activation checkpointing, :func:`~.model_shapes.checkpointed_activation_bytes`), with the fused
loss (no logits: :mod:`.chunked_loss` or liger-kernel's fused linear cross-entropy) only when the
model has one or ``loss`` says so; other models need ``activations=``. On a device without a memory
cap (the CPU) nothing needs streaming or release: the first candidate, all resident, no release.
:func:`wrap` wraps an optimizer with the choice and logs one line (logger ``optstate.auto``).
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ..optimizer import VirtualOptimizer
from ..presets import make_policy
from ..presets import wrap as wrap_with_policy
from ..state.pinned import FAST_PINNING
from ..state.units import parse_bytes
from .chunked_loss import has_chunked_loss
from .model_shapes import checkpointed_activation_bytes
from .plan import DTYPES, RELEASE_BUCKET_BYTES, hints, gib, make_plan
from .recipe import CANDIDATES, DEFAULT_SEQ, PLANNED, pick

log = logging.getLogger("optstate.auto")

#: fp32 and fp16 parameters: int8 state resident, 4-bit resident, int8 in host memory (streamed)
PLAIN_CANDIDATES = ("8bit", "4bit", "offload")
#: ``loss`` -> whether the loss materializes no logits (the planner's ``fused_loss``)
LOSSES = {"plain": False, "fused": True, "chunked": True, "liger": True}
#: what the 8B recipe sets before CUDA starts (docs/large-models.md#run-it)
EXPANDABLE = "expandable_segments:True"
ALLOC_ENV = "PYTORCH_CUDA_ALLOC_CONF"
NO_CAP = 2**62  # the planner's gpu_memory where the device has no cap
OPTIMIZERS = ("AdamW", "Adam")  # the recipe's optimizer; Adam keeps the same two moments
#: what :func:`wrap` takes for :func:`choose` beside the wrapper's options (``release_gradients`` is both)
OPTIONS = ("device", "gpu_memory", "micro_batch", "seq_len", "loss", "activations")


@dataclass(frozen=True)
class Choice:
    """What :func:`choose` picked, the planner's expected peak, and where each input came from."""
    preset: str
    gpu_budget: Optional[int]
    release_gradients: bool
    peak: int  # the planner's total for the row: weights, gradients, state on the device, activations, staging
    gpu_memory: Optional[int]  # None: no cap (the CPU)
    n_params: int
    dtype: str
    device: str
    micro_batch: int
    seq_len: int
    loss: str
    activations: int  # bytes counted for them at the peak (0: not counted)
    notes: Tuple[str, ...] = ()

    def wrap_options(self) -> dict:
        """The options of ``optstate_core.wrap`` that go with :attr:`preset`."""
        return {"release_gradients": self.release_gradients,
                **({"gpu_budget": self.gpu_budget} if self.gpu_budget is not None else {})}

    def describe(self) -> str:
        """The one log line: what was chosen, from what, and the peak it expects."""
        budget = f" + gpu_budget={self.gpu_budget / 2**30:.2f}GiB" if self.gpu_budget is not None else ""
        memory = gib(self.gpu_memory) if self.gpu_memory is not None else "no cap"
        fused = "no logits" if LOSSES[self.loss] else "logits materialized"
        return (f"optstate auto: {self.preset}{budget}, release_gradients={self.release_gradients} for "
                f"{self.n_params / 1e9:.3f}B {self.dtype} parameters on {self.device} ({memory}), micro-batch "
                f"{self.micro_batch} x {self.seq_len} tokens, loss {self.loss} ({fused}); expected peak "
                f"{gib(self.peak)} (activations {gib(self.activations)})" + "".join(f"; {n}" for n in self.notes))


def choose(model, *, params: Optional[Sequence[torch.Tensor]] = None, device=None, gpu_memory=None,
           micro_batch: Optional[int] = None, seq_len: Optional[int] = None, loss: Optional[str] = None,
           activations=None, release_gradients: Optional[bool] = None, checkpointing: Optional[bool] = None,
           release_bucket_bytes=None, context: Sequence[str] = ()) -> Choice:
    """The preset, ``gpu_budget`` and release for training ``params`` (default: ``model``'s trainable
    parameters) of ``model`` (see the module doc). ``gpu_memory``: bytes to plan for (default: the
    device's, free plus this process's reserve, within a per-process fraction; no cap off CUDA);
    ``micro_batch`` (default 1) and ``seq_len`` (default the config's ``max_position_embeddings``);
    ``loss``: one of :data:`LOSSES` (default: detected on the model); ``activations``: bytes at the
    peak (default: the planner's estimate, Llama-family configs only); ``release_gradients``
    (default: on a capped device); ``context``: notes for the log line. Raises ValueError naming
    the argument for a bad input, and when nothing fits."""
    named, frozen = _trained(model, params)
    dtype = _dtype(p for _, p in named)
    device = torch.device(device) if device is not None else named[0][1].device
    notes: List[str] = list(context)
    if device.type == "cuda":
        _apply_allocator_settings(notes)  # while CUDA may not have started yet
    cap = _cap(device, gpu_memory, notes)
    micro_batch = _positive("micro_batch", 1 if micro_batch is None else micro_batch)
    config = _config(model)
    seq_len = _seq_len(seq_len, config, notes)
    loss = _loss(model, loss, notes)
    activations, estimated = _activations(activations, config, micro_batch, seq_len, LOSSES[loss], cap, notes)
    if estimated and (_checkpointing(model) if checkpointing is None else checkpointing) is False:
        notes.append("activations estimated with activation checkpointing, which is off: the peak will be higher")
    if release_gradients is None:
        release_gradients = cap is not None
    elif not isinstance(release_gradients, bool):
        raise ValueError(f"release_gradients must be None, True or False, got {release_gradients!r}")
    bucket = RELEASE_BUCKET_BYTES if release_bucket_bytes is None else \
        parse_bytes(release_bucket_bytes, "release_bucket_bytes", allow_zero=True)
    presets, candidates = (PLANNED, CANDIDATES) if dtype == "bf16" else (PLAIN_CANDIDATES, PLAIN_CANDIDATES)
    plan = make_plan([(n, tuple(p.shape)) for n, p in named], NO_CAP if cap is None else cap, "adamw", presets,
                     dtype, dtype, activations + frozen, release_gradients=release_gradients,
                     release_bucket_bytes=bucket)
    row = pick(plan, candidates)
    if row is None:
        raise ValueError(f"model: no preset fits its {plan.n_params / 1e9:.3f}B {dtype} parameters in "
                         f"{gib(cap)} at micro-batch {micro_batch} x {seq_len}: " + "; ".join(hints(plan)))
    if frozen:
        notes.append(f"frozen parameters {gib(frozen)} counted")
    _allocator_notes(device, row.state.host > 0, notes)
    return Choice(row.name.split(" + ")[0], row.gpu_budget, release_gradients, row.total_gpu, cap, plan.n_params,
                  dtype, str(device), micro_batch, seq_len, loss, activations, tuple(notes))


def wrap(optimizer: torch.optim.Optimizer, model=None, **options) -> VirtualOptimizer:
    """``optimizer`` wrapped with what :func:`choose` picks for ``model`` (logged on one line).
    ``options``: :func:`choose`'s (``micro_batch``, ``seq_len``, ``loss``, ``gpu_memory``,
    ``activations``, ``device``, ``release_gradients``) and the wrapper's; ``gpu_budget``, ``offload``
    and ``policy`` are the choice's (``stream_weights=True`` plans with release). The optimizer is untouched
    when an argument is refused."""
    if not isinstance(optimizer, torch.optim.Optimizer) or isinstance(optimizer, VirtualOptimizer):
        raise ValueError(f"optimizer must be a torch optimizer (not yet wrapped), got {type(optimizer).__name__}")
    if type(optimizer).__name__ not in OPTIMIZERS:
        raise ValueError(f"optimizer: preset 'auto' plans for {' or '.join(OPTIMIZERS)} (the planner's recipe), "
                         f"got {type(optimizer).__name__}: wrap it with a preset name instead")
    for key in ("gpu_budget", "offload", "policy"):
        if key in options:
            raise ValueError(f"{key}: preset 'auto' chooses it; leave it out, or wrap with a preset name")
    mine = {k: options.pop(k) for k in OPTIONS + ("release_gradients",) if k in options}
    if options.get("stream_weights") is True:
        mine.setdefault("release_gradients", True)  # streamed weights are updated in backward
    params = [p for group in optimizer.param_groups for p in group["params"]]
    choice = choose(model, params=params, release_bucket_bytes=options.get("release_bucket_bytes"), **mine)
    log.info("%s", choice.describe())
    options.setdefault("named_parameters", model)
    return wrap_with_policy(optimizer, make_policy(choice.preset), **options, **choice.wrap_options())


def _trained(model, params) -> Tuple[List[Tuple[str, torch.Tensor]], int]:
    """``[(name, parameter)]`` trained, and the bytes of ``model``'s other (frozen) parameters."""
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"model: preset 'auto' plans from the model being trained (a torch.nn.Module), "
                         f"got {type(model).__name__}")
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad] if params is None else None
    if named is None:
        names = {id(p): n for n, p in model.named_parameters()}
        outside = [p for p in params if id(p) not in names]
        if outside:
            raise ValueError(f"model: the optimizer trains {len(outside)} parameter(s) that are not the model's; "
                             "pass the model they belong to")
        named = list({id(p): (names[id(p)], p) for p in params}.values())
    if not named:
        raise ValueError("model: no parameter to train (none requires grad)")
    trained = {id(p) for _, p in named}
    frozen = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in trained)
    return named, frozen


def _dtype(params) -> str:
    """The planner's name of the dtype that holds most of the elements."""
    count: Dict[torch.dtype, int] = {}
    for p in params:
        count[p.dtype] = count.get(p.dtype, 0) + p.numel()
    dtype = max(count, key=count.get)
    names = {v: k for k, v in DTYPES.items()}
    if dtype not in names:
        raise ValueError(f"model: preset 'auto' plans {', '.join(DTYPES)} parameters, got {dtype}")
    return names[dtype]


def _positive(arg: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{arg} must be a positive integer, got {value!r}")
    return value


def _cap(device: torch.device, gpu_memory, notes: List[str]) -> Optional[int]:
    """The bytes to plan for: ``gpu_memory``, else the CUDA device's, else None (no cap)."""
    if gpu_memory is not None:
        return parse_bytes(gpu_memory, "gpu_memory")
    if device.type != "cuda":
        notes.append(f"{device.type}: no memory cap, so all state resident and no release")
        return None
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        raise ValueError(f"gpu_memory: preset 'auto' plans for one GPU, and WORLD_SIZE is {world}: name a preset "
                         "(optstate plan --gpus N), or pass gpu_memory= to plan each rank as one GPU")
    free, total = torch.cuda.mem_get_info(device)
    fraction = torch.cuda.get_per_process_memory_fraction(device) \
        if hasattr(torch.cuda, "get_per_process_memory_fraction") else 1.0
    usable = min(int(total * fraction), free + torch.cuda.memory_reserved(device))
    notes.append(f"{gib(usable)} usable of {gib(total)}: free plus this process's reserve"
                 + (f", within its fraction {fraction:g}" if fraction < 1 else "") + " (gpu_memory= to override)")
    return usable


def _checkpointing(model) -> Optional[bool]:
    """Whether a transformers model checkpoints activations (``is_activation_checkpointing`` from 5.2x
    on, ``is_gradient_checkpointing`` before); None for other models."""
    name = next((n for n in ("is_activation_checkpointing", "is_gradient_checkpointing") if hasattr(type(model), n)),
                None)
    return getattr(model, name) if name else None


def _config(model) -> Optional[dict]:
    """The model's Hugging Face config as a dict, or None."""
    config = getattr(model, "config", None)
    if isinstance(config, dict):
        return config
    to_dict = getattr(config, "to_dict", None)
    return to_dict() if callable(to_dict) else None


def _seq_len(seq_len, config: Optional[dict], notes: List[str]) -> int:
    if seq_len is not None:
        return _positive("seq_len", seq_len)
    text = (config or {}).get("text_config") or config or {}
    for key in ("max_position_embeddings", "n_positions"):
        if isinstance(text.get(key), int) and text[key] > 0:
            notes.append(f"sequence length from config.{key} (seq_len= to override)")
            return text[key]
    notes.append(f"sequence length {DEFAULT_SEQ} assumed (seq_len= to override)")
    return DEFAULT_SEQ


def _loss(model, loss: Optional[str], notes: List[str]) -> str:
    """``loss`` checked, or the one the model computes: chunked, liger-kernel's, or plain."""
    if loss is not None:
        if loss not in LOSSES:
            raise ValueError(f"loss must be one of {', '.join(LOSSES)}, got {loss!r}")
        return loss
    forward = getattr(model, "forward", None)
    if has_chunked_loss(model):
        return "chunked"
    if (getattr(getattr(forward, "__func__", forward), "__module__", None) or "").startswith("liger_kernel"):
        return "liger"
    notes.append("no fused loss found on the model, so its logits are counted (loss= to override)")
    return "plain"


def _activations(activations, config, micro_batch: int, seq_len: int, fused: bool, cap,
                 notes: List[str]) -> Tuple[int, bool]:
    """``(bytes, estimated)``: ``activations`` as given, or the planner's estimate for a Llama-family config."""
    if activations is not None:
        return parse_bytes(activations, "activations", allow_zero=True), False
    try:
        return checkpointed_activation_bytes(config or {}, micro_batch, seq_len, fused_loss=fused), True
    except ValueError:
        if cap is not None:
            raise ValueError("activations: preset 'auto' estimates activations for Llama-family configs only "
                             "(hidden_size, intermediate_size, num_hidden_layers, vocab_size); pass activations= "
                             "(bytes at the micro-batch's peak, e.g. measured with optstate bench --peak-bytes)") \
                from None
        notes.append("activations not counted (no Llama-family config; activations= to count them)")
        return 0, False


def _allocator_settings(environ=None) -> List[str]:
    """The recipe's allocator settings missing from ``PYTORCH_CUDA_ALLOC_CONF``/``PYTORCH_ALLOC_CONF``."""
    environ = os.environ if environ is None else environ
    present = environ.get(ALLOC_ENV, "") + "," + environ.get("PYTORCH_ALLOC_CONF", "")
    wanted = [EXPANDABLE, *FAST_PINNING.split(",")]
    return [s for s in wanted if s.split(":")[0] not in present]


def _apply_allocator_settings(notes: List[str], environ=None, cuda_started: Optional[bool] = None) -> None:
    """Before CUDA starts: add the missing settings to ``PYTORCH_CUDA_ALLOC_CONF``."""
    environ = os.environ if environ is None else environ
    started = torch.cuda.is_initialized() if cuda_started is None else cuda_started
    missing = _allocator_settings(environ)
    if missing and not started:
        environ[ALLOC_ENV] = ",".join(s for s in [environ.get(ALLOC_ENV, ""), *missing] if s)
        notes.append(f"set {ALLOC_ENV}={environ[ALLOC_ENV]} (CUDA had not started)")


def _allocator_notes(device: torch.device, host_state: bool, notes: List[str], environ=None) -> None:
    """On CUDA, the recipe's settings still missing (the pinning ones only with state in host memory)."""
    if device.type != "cuda":
        return
    missing = [s for s in _allocator_settings(environ) if host_state or not s.startswith("pinned")]
    if missing:
        notes.append(f"set {ALLOC_ENV}={','.join(missing)} before CUDA starts (docs/large-models.md#run-it)")
