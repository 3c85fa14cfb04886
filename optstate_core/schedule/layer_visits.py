"""Where a decoder layer is in a training step, as its hooks see it: inside a checkpoint's forward
or its recompute, and which modules are the layers (for weight streaming and activation offload)."""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch
from torch import nn


def in_backward() -> bool:
    """Whether autograd's engine is running a backward on this thread (a checkpoint's recompute)."""
    return torch._C._current_graph_task_id() != -1


def under_checkpoint() -> bool:
    """Whether this forward runs inside non-reentrant activation checkpointing (autograd keeps
    nothing of it: the recompute in backward runs the forward again)."""
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return bool(hooks) and getattr(hooks[0], "__qualname__", "").startswith("_checkpoint_hook")


def checkpoints_itself(module: nn.Module) -> bool:
    """Whether ``module``'s training forward checkpoints inside its own ``forward``, under its hooks
    (transformers' ``GradientCheckpointingLayer`` from 5.2x on): its hooks then run outside the
    checkpoint, once, and its recompute in backward runs no hook."""
    return bool(getattr(module, "gradient_checkpointing", False)) and module.training and torch.is_grad_enabled()


def first_grad_output(output) -> Optional[torch.Tensor]:
    """The first tensor of a layer's output that autograd will send a gradient to, or None."""
    for o in (output if isinstance(output, (tuple, list)) else (output,)):
        if isinstance(o, torch.Tensor) and o.requires_grad:
            return o
    return None


def decoder_layers(model: nn.Module) -> List[nn.Module]:
    """The model's repeated blocks: the children of its largest ``nn.ModuleList`` (``model.layers``
    of a Hugging Face causal LM, ``h`` of GPT-2)."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m)]
    if not lists:
        raise ValueError("stream_weights: the model has no nn.ModuleList of layers; pass layers=[...]")
    best = max(lists, key=lambda m: sum(p.numel() for p in m.parameters()))
    return list(best)


def checked_layers(caller: str, model: nn.Module, layers: Optional[Sequence[nn.Module]], prefetch) -> List[nn.Module]:
    """``layers`` (default the model's decoder layers) and ``prefetch`` checked for ``caller``: a
    ValueError naming the argument for a bad one."""
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
        raise ValueError(f"{caller}: prefetch must be an int >= 0 (layers copied in ahead), got {prefetch!r}")
    layers = decoder_layers(model) if layers is None else list(layers)
    for i, layer in enumerate(layers):
        if not isinstance(layer, nn.Module):
            raise ValueError(f"{caller}: layers[{i}] must be an nn.Module, got {type(layer).__name__}")
    return layers


def stays_over_the_turn(i: int, count: int, prefetch: int) -> bool:
    """Whether layer ``i`` of ``count`` is among the last ``prefetch + 1`` of a forward, whose
    recompute and backward come first: what they hold stays on the device across the turn."""
    return i >= count - 1 - prefetch
