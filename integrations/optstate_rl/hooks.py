"""The RL frameworks' optimizer offload helpers, routed to the phase switch for optstate optimizers.

verl parks its optimizer with ``offload_fsdp_optimizer(optimizer)`` and wakes it with
``load_fsdp_optimizer(optimizer, device_id)`` (``verl/utils/fsdp_utils.py``, imported by name
into its workers); NeMo-RL's DTensor workers call their method ``move_optimizer_to_device(device)``.
Each moves every ``torch.Tensor`` in ``optimizer.state`` with ``.to()``: optstate's compressed
state is not a ``torch.Tensor`` (it would stay on the GPU) and a per-tensor loop has neither
kept pinned buffers nor one wait. :func:`install_hooks` replaces those helpers, in the modules
already imported, by ones that call ``offload(empty_cache=True)``/``reload()`` when the optimizer
is an optstate one and the original otherwise. verl's and NeMo-RL's sources as read: verl main of 2026-01-29,
NeMo-RL main of 2026-08-22.
"""
from __future__ import annotations

import functools
import logging
import sys
from typing import List

import torch

import optstate_core as oc

log = logging.getLogger("optstate.rl")

VERL_SOURCE = "verl.utils.fsdp_utils"


virtual_optimizer = oc.unwrap  # the optstate optimizer in a framework's optimizer, or None


def _verl_hook(original, switch):
    """verl's ``original`` helper (``offload_fsdp_optimizer``/``load_fsdp_optimizer``): for an optstate
    optimizer ``switch(opt)`` instead, for any other optimizer the helper itself."""
    @functools.wraps(original)
    def hooked(optimizer, *args, **kwargs):
        opt = virtual_optimizer(optimizer)
        if opt is None:
            return original(optimizer, *args, **kwargs)
        switch(opt)
    hooked.optstate_original = original
    return hooked


#: verl's helper -> what it does for an optstate optimizer (the load goes to the parameters' device, verl's device_id)
_VERL_SWITCHES = {"offload_fsdp_optimizer": lambda opt: opt.offload(empty_cache=True),  # the rollout takes the memory
                  "load_fsdp_optimizer": lambda opt: opt.reload()}


def _nemo_move(original):
    @functools.wraps(original)
    def move_optimizer_to_device(self, device, *args, **kwargs):
        opt = virtual_optimizer(getattr(self, "optimizer", None))
        if opt is None:
            return original(self, device, *args, **kwargs)
        if torch.device(device).type == "cpu":
            opt.offload(empty_cache=True)
        else:
            opt.reload()
    move_optimizer_to_device.optstate_original = original
    return move_optimizer_to_device


def _modules(prefix: str):
    return [(name, m) for name, m in list(sys.modules.items())
            if m is not None and (name == prefix or name.startswith(prefix + "."))]


def _hook_verl() -> List[str]:
    source = sys.modules.get(VERL_SOURCE)
    if source is None:
        return []
    done = []
    for name, switch in _VERL_SWITCHES.items():
        original = getattr(source, name, None)
        if original is None or hasattr(original, "optstate_original"):
            continue
        hooked = _verl_hook(original, switch)
        for module_name, module in _modules("verl"):  # the helper and every module that imported it by name
            if vars(module).get(name) is original:
                setattr(module, name, hooked)
                done.append(f"{module_name}.{name}")
    return done


def _hook_nemo_rl() -> List[str]:
    done = []
    for module_name, module in _modules("nemo_rl"):
        for cls in list(vars(module).values()):
            method = vars(cls).get("move_optimizer_to_device") if isinstance(cls, type) else None
            if callable(method) and not hasattr(method, "optstate_original") and cls.__module__ == module_name:
                cls.move_optimizer_to_device = _nemo_move(method)
                done.append(f"{module_name}.{cls.__name__}.move_optimizer_to_device")
    return done


def install_hooks() -> List[str]:
    """Route the offload helpers of verl and NeMo-RL imported in this process to the phase switch
    (see the module doc); idempotent. Returns what was replaced now."""
    done = _hook_verl() + _hook_nemo_rl()
    if done:
        log.info("optstate: %s call offload()/reload() for optstate optimizers", ", ".join(done))
    return done
