"""Where a decoder layer is in a training step, as its hooks see it: inside a checkpoint's forward
or its recompute, and which modules are the layers (for weight streaming and activation offload)."""
from __future__ import annotations

from typing import List, Optional

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
