"""``OptstateOptimizersContainer``: torchtitan's optimizer container, each optimizer wrapped by optstate.

torchtitan (0.3.0) builds one optimizer per (model part, optimizer name) in
``OptimizersContainer.__init__`` through ``_resolve_optimizer_factory``; this subclass returns a
factory that builds the same torch optimizer and wraps it (``optstate_core.wrap``), so every
object in ``container.optimizers`` is a ``VirtualOptimizer``: a ``torch.optim.Optimizer`` whose
``param_groups`` are the torch optimizer's own (the ``LambdaLR`` that torchtitan builds per
optimizer schedules them, ``param_names`` included).

Checkpoints go through torchtitan's own path: ``state_dict()`` returns the flat
``state.{fqn}.{name}`` / ``param_groups.{fqn}.{key}`` dict torchtitan's checkpointer hands to
DCP. The compressed state is nested (``state.{fqn}.exp_avg.encoded.payload.codes`` ...), and its
tensors are DTensors with the global payload shape under FSDP2, so a checkpoint reshards. Loading
reads back every key the wrapper's own ``state_dict()`` has, including the ``optstate`` entry of
its param groups (step count, rounding seed, clipping state), which torchtitan's loader, walking
the live param groups, would drop.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.nn as nn

import optstate_core as oc
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.components.optimizer.utils import (get_flat_optim_state_dict, init_optim_state,
                                                   load_flat_optim_state_dict)

log = logging.getLogger("optstate.torchtitan")

#: optimizer names of torchtitan's lookup that stay unwrapped: DistMuon redistributes its
#: parameters itself (FlexShard) and keeps state in its own compute layout
UNWRAPPED = ("DistMuon",)


class OptstateOptimizersContainer(OptimizersContainer):
    """torchtitan's ``OptimizersContainer`` with each optimizer wrapped by ``optstate_core.wrap``."""

    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        optstate_preset: str = "8bit"
        """optstate preset for the state of every optimizer (``8bit``, ``4bit``, ``bf16``, ``fp32``,
        ``offload``, ...; ``optstate_core.PRESETS``)."""

        optstate_release_gradients: bool = False
        """Update each parameter in backward, right after FSDP2's reduce-scatter, and free its
        gradient there. The trainer's own clipping then sees no gradient: the optimizer clips at
        ``optstate_max_grad_norm``. Needs one forward/backward per step (no gradient accumulation,
        no pipeline parallelism), ``training.disable_cuda_graphs = True`` on CUDA, and FSDP2 over
        one 1-D mesh (or a single process)."""

        optstate_max_grad_norm: float = 1.0
        """With gradient release: the norm the optimizer clips to (set it to ``training.max_norm``;
        0 turns clipping off). Without release it is not used: torchtitan clips before ``step()``."""

        optstate_clip_mode: str = "auto"
        """With gradient release: ``auto``, ``previous``, ``per_tensor`` (docs/master-weights.md)."""

        optstate_wrap_options: dict[str, Any] = field(default_factory=dict)
        """Further keyword arguments of ``optstate_core.wrap`` (``gpu_budget``, ``offload``,
        ``release_bucket_bytes``, ``chunk_bytes``, ...)."""

    def __init__(self, config: Config, *, model_parts: list[nn.Module]) -> None:
        if config.implementation == "fused_opt_states_bf16":
            raise ValueError("optstate: optimizer.implementation = 'fused_opt_states_bf16' creates the state in "
                             "bf16 itself; with optstate the state's format is the preset's (e.g. 'bf16'): use "
                             "implementation 'fused', 'foreach' or 'for-loop'")
        self._optstate_kwargs = wrap_kwargs(config)  # read by _resolve_optimizer_factory during __init__
        self._optstate_preset = config.optstate_preset
        self._forwards = 0
        self._guard_handles = []
        super().__init__(config, model_parts=model_parts)
        if config.optstate_release_gradients:
            for model in self.model_parts:
                self._guard_handles.append(model.register_forward_pre_hook(self._release_guard))

    # -- building ---------------------------------------------------------------------------------
    def _resolve_optimizer_factory(self, name: str):
        build = OptimizersContainer._resolve_optimizer_factory(name)
        if name in UNWRAPPED:
            log.warning("optstate: %s keeps its own state layout and stays unwrapped", name)
            return build

        def build_and_wrap(param_groups, **factory_kwargs):
            inner = build(param_groups, **factory_kwargs)
            named = [(n, p) for g in inner.param_groups for n, p in zip(g.get("param_names", ()), g["params"])]
            return oc.wrap(inner, self._optstate_preset, named_parameters=named, **self._optstate_kwargs)

        return build_and_wrap

    # -- the train step ---------------------------------------------------------------------------
    def _release_guard(self, module, args) -> None:
        """Gradient release updates parameters in the backward of the micro-batch: a second forward
        with gradients before ``step()`` (gradient accumulation, pipeline micro-batches) would be a
        second update, and a captured CUDA graph would not replay the hooks' host work."""
        if not torch.is_grad_enabled() or not module.training:
            return
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("optstate: gradient release cannot run inside a CUDA graph capture: set "
                               "training.disable_cuda_graphs = True (--training.disable_cuda_graphs)")
        self._forwards += 1
        if self._forwards > len(self.model_parts):
            raise RuntimeError("optstate: gradient release updates the parameters in every backward, but this "
                               "step runs more than one forward/backward before optimizers.step() (gradient "
                               "accumulation or pipeline parallelism). Make training.global_batch_size equal the "
                               "local batch size times the data-parallel degree, or set "
                               "optimizer.optstate_release_gradients = False")

    def step(self, closure=None):
        self._forwards = 0
        return super().step(closure)

    # -- checkpoints: torchtitan's flat FQN keys --------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        flat: dict[str, Any] = {}
        for optim in self.optimizers:
            create_state(optim)
            flat.update(get_flat_optim_state_dict(optim))
        return flat

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for optim in self.optimizers:
            create_state(optim)
            if isinstance(optim, oc.VirtualOptimizer):
                optim.load_state_dict(unflatten(optim, state_dict))
            else:
                load_flat_optim_state_dict(optim, state_dict)


def wrap_kwargs(config) -> dict:
    """``optstate_core.wrap`` keyword arguments from the container's config."""
    oc.make_policy(config.optstate_preset)  # an unknown preset fails here, naming the valid ones
    options = dict(config.optstate_wrap_options)
    if config.optstate_release_gradients:
        options.setdefault("release_gradients", True)
        options.setdefault("max_grad_norm", config.optstate_max_grad_norm or None)
        options.setdefault("clip_mode", config.optstate_clip_mode)
    return options


def create_state(optim: torch.optim.Optimizer) -> None:
    """torchtitan's state-creating step (zero gradients, lr 0), also under gradient release.

    With release, ``step()`` updates only gradients that backward did not release; the zero
    gradients set here never went through backward, so the step updates (and creates the state
    of) every parameter as it would without release."""
    init_optim_state(optim)


def unflatten(optim: "oc.VirtualOptimizer", flat: dict[str, Any]) -> dict[str, Any]:
    """The wrapper's own ``state_dict()`` layout, every leaf taken from torchtitan's flat dict.

    The template is this optimizer's ``state_dict()`` (its state exists: ``create_state``), so
    every key it saves is read back, nested payloads and the param groups' ``optstate`` entry
    included; a key the flat dict lacks is an error naming it."""
    template = optim.state_dict()
    fqn_of: dict[int, str] = {}
    groups = []
    for group in template["param_groups"]:
        names = group.get("param_names")
        if names is None:
            raise ValueError("optstate: torchtitan's optimizer param groups carry param_names; this one has none")
        fqn_of.update(zip(group["params"], names))
        loaded = {"params": list(group["params"]), "param_names": list(names)}
        for key, value in group.items():
            if key not in loaded and names:
                loaded[key] = _take(flat, f"param_groups.{names[0]}.{key}")
        groups.append(loaded)
    state = {index: _fill(entry, f"state.{fqn_of[index]}", flat) for index, entry in template["state"].items()}
    # only state and groups: the template's top-level "optstate" entry is this optimizer's own (fresh)
    # metadata; the checkpoint's rides in the first group
    return {"state": state, "param_groups": groups}


def _fill(template: Any, prefix: str, flat: dict[str, Any]) -> Any:
    if isinstance(template, dict):
        return {key: _fill(value, f"{prefix}.{key}", flat) for key, value in template.items()}
    return _take(flat, prefix)


def _take(flat: dict[str, Any], key: str) -> Any:
    if key not in flat:
        raise KeyError(f"optstate: the checkpoint's optimizer state has no {key!r} (was it saved with another "
                       "preset, or without optstate?)")
    return flat[key]
