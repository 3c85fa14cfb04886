"""Master weights as optimizer state: bf16 parameters plus an integer correction that restores fp32.

The scheme (integer arithmetic on the IEEE bit patterns: exact and device-agnostic). Let ``m``
be the magnitude bits of the fp32 master ``x`` (its int32 pattern without the sign bit):

* ``b = (m + 2**15) >> 16``    the bf16 parameter's magnitude (nearest, ties away from zero);
* ``d = m - (b << 16)``        the correction, an integer in ``[-2**15, 2**15 - 1]``.

The parameter holds ``b`` with ``x``'s sign; the state ``master_correction`` holds ``d`` (its
decoded value, an integer-valued float). Reconstruction: ``m = (b << 16) + d``. The codec of the
state decides how much of ``d`` is kept:

* ``corr16`` (int16, 2 bytes): ``d`` exactly, so the master is the fp32 value bit for bit
  (24-bit significand);
* ``corr8`` (int8, 1 byte): ``d`` rounded to a multiple of 256, so ``|x_hat - x| <= 255``
  fp32 ulps of ``x`` (``< 2**-15 |x|`` for normal ``x``; ``<= 128`` ulps unless ``d > 32639``),
  a master with a 16-bit significand, like a 24-bit float.

In both cases the parameter is ``x`` rounded to nearest bf16 (``|b - x| <= ulp_bf16(x) / 2``).
Bounds hold for finite ``|x| <= 3.3961e38`` (bf16's largest finite value plus half an ulp);
larger finite magnitudes saturate there, NaN/inf masters give NaN/inf parameters and a zero
correction. A parameter changed outside the optimizer keeps its old correction: the master is
then the new bf16 value plus at most half a bf16 ulp.
"""
from __future__ import annotations

import logging
from typing import Dict, Optional

import torch
from torch.utils.weak import WeakIdKeyDictionary

from .dtensor import is_dtensor, like_param, local

log = logging.getLogger("optstate")

MASTER_KEY = "master_correction"
MASTER_DTYPES = (torch.bfloat16,)
_SIGN32 = 1 << 31
_INF_MAG = 0x7F800000
_BF16_MAX_MAG = 0x7F7F


MAX_MAGNITUDE = (_BF16_MAX_MAG << 16) + 0x7FFF  # the largest magnitude with a finite bf16 part


def split(master: torch.Tensor):
    """``(bf16 parameter, correction)`` of an fp32 master (correction: integer-valued float32)."""
    x = master.detach().to(torch.float32).contiguous()
    i32 = x.view(torch.int32).to(torch.int64)
    neg = i32 < 0
    mag = i32 & 0x7FFFFFFF
    finite = mag < _INF_MAG
    m = torch.clamp(mag, max=MAX_MAGNITUDE)
    b = (m + 0x8000) >> 16
    d = m - (b << 16)
    nan_mag = (mag >> 16) | torch.where(mag > _INF_MAG, 0x40, 0)  # NaN stays NaN in bf16
    b = torch.where(finite, b, nan_mag)
    d = torch.where(finite, d, 0)
    pattern = b | torch.where(neg, 0x8000, 0)
    pattern = torch.where(pattern >= 0x8000, pattern - 0x10000, pattern)
    return pattern.to(torch.int16).view(torch.bfloat16), d.to(torch.float32)


def join(param: torch.Tensor, correction: torch.Tensor) -> torch.Tensor:
    """The fp32 master from a bf16 parameter and its (decoded) correction; see the module doc."""
    if param.dtype != torch.bfloat16:
        raise ValueError(f"master weights need a bfloat16 parameter, got {param.dtype}")
    pattern = param.detach().contiguous().view(torch.int16).to(torch.int64) & 0xFFFF
    neg = pattern >= 0x8000
    b = pattern & 0x7FFF
    d = correction.to(torch.float32).reshape(param.shape).round().to(torch.int64)
    mag = torch.where(b < (_INF_MAG >> 16), ((b << 16) + d).clamp(min=0, max=0x7FFFFFFF), b << 16)
    i32 = torch.where(neg, mag - _SIGN32, mag)  # sign bit set: the int32 pattern is negative
    return i32.to(torch.int32).view(torch.float32)


# -- seeds: corrections known before the optimizer first steps a parameter ---------------------------
_SEEDS = WeakIdKeyDictionary()  # parameter -> int16 correction (by identity, dropped with the parameter)


def cast_model(model: torch.nn.Module, dtype: torch.dtype = torch.bfloat16) -> Dict[str, int]:
    """Cast a model's floating-point parameters to ``dtype`` in place, keeping every parameter
    object (so optimizers built before or after see the same tensors), and remember what the
    cast dropped: an optimizer with master weights (a ``bf16w-*`` preset) starts from the exact
    fp32 values. Buffers are cast too. Returns ``{"params": n, "elements": n}`` cast."""
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if dtype not in MASTER_DTYPES:
        raise ValueError(f"dtype must be torch.bfloat16 (master weights keep bf16 parameters), got {dtype!r}")
    n = elements = 0
    with torch.no_grad():
        for p in model.parameters():
            if not p.is_floating_point() or p.dtype == dtype:
                continue
            low, corr = split(p.data)
            _SEEDS[p] = corr.to(torch.int16)
            p.data = low
            if p.grad is not None:
                p.grad = p.grad.to(dtype)
            n += 1
            elements += p.numel()
        for module in model.modules():
            for name, buf in module.named_buffers(recurse=False):
                if buf is not None and buf.is_floating_point() and buf.dtype != dtype:
                    setattr(module, name, buf.to(dtype))
    log.info("optstate: cast %d parameters (%d elements) to %s; their fp32 remainder seeds the master weights",
             n, elements, dtype)
    return {"params": n, "elements": elements}


def seed_of(param: torch.Tensor) -> Optional[torch.Tensor]:
    """The correction remembered for ``param`` by :func:`cast_model`, or None."""
    seed = _SEEDS.get(param)
    if seed is None or tuple(seed.shape) != tuple(param.shape):
        return None
    return seed.to(torch.float32)


def forget_seed(param: torch.Tensor) -> None:
    _SEEDS.pop(param, None)


def seeds_by_index(params) -> Dict[int, torch.Tensor]:
    """The remembered corrections of ``params`` by position (what a copy or pickle of an optimizer
    carries: its parameters are new objects, so :func:`restore_seeds` re-keys them)."""
    return {i: _SEEDS[p] for i, p in enumerate(params) if p in _SEEDS}


def restore_seeds(params, seeds: Dict[int, torch.Tensor]) -> None:
    """Remember ``seeds`` (from :func:`seeds_by_index`) for the parameters at those positions."""
    for i, p in enumerate(params):
        if i in seeds:
            _SEEDS[p] = seeds[i]


def set_seed(param: torch.Tensor, master: torch.Tensor) -> None:
    """Make ``master`` (fp32) the parameter's master: the bf16 part goes into the parameter now,
    the rest is picked up by the optimizer at its next step."""
    low, corr = split(master.to(param.device))
    with torch.no_grad():
        param.copy_(low)
    _SEEDS[param] = corr.to(torch.int16)


# -- the reference step: fp32 master in, bf16 parameter + correction out ------------------------------
def open_tile(tile) -> None:
    """Before the inner update: make the tile's tensor the fp32 master (bf16 view + correction)
    with an fp32 gradient; the correction leaves the state the inner optimizer sees."""
    low = tile.tensor
    correction = tile.states.pop(MASTER_KEY, None)
    if correction is None:
        seed = seed_of(tile.work.key)
        if seed is not None:
            seed = seed.to(low.device)
            correction = seed if tile.whole else seed.reshape(-1)[tile.start:tile.stop]
        else:
            correction = torch.zeros(low.shape, dtype=torch.float32, device=low.device)
    master = join(low, correction)
    if low.grad is not None:
        master.grad = low.grad.to(torch.float32)
    tile.master = low
    tile.tensor = master


def close_tile(tile) -> None:
    """After the inner update: round the master back into the parameter and the correction."""
    low = tile.master
    param, correction = split(tile.tensor)
    low.copy_(param.view(low.shape))
    tile.states[MASTER_KEY] = correction.view(low.shape)
    tile.tensor = low
    tile.master = None


# -- export and import -------------------------------------------------------------------------------
EXPORT_KEY = "master_weights"


def master_of(engine, param: torch.Tensor) -> torch.Tensor:
    """The fp32 master of one parameter now (its own values when it keeps no correction)."""
    value = engine.state.get(param, {}).get(MASTER_KEY)
    if param.dtype != torch.bfloat16 or value is None:
        seed = seed_of(param) if param.dtype == torch.bfloat16 else None
        return join(param, seed) if seed is not None else param.detach().to(torch.float32)
    correction = value.decode(param.device) if hasattr(value, "decode") and not isinstance(value, torch.Tensor) \
        else value
    if is_dtensor(param):  # FSDP2: the local shard's master, as a DTensor laid out like the parameter
        return like_param(param, join(local(param), local(correction).reshape(local(param).shape)))
    return join(param, correction)


def export_masters(engine, param_groups, exported: dict, device="cpu") -> dict:
    """Move the corrections out of an exported (plain torch) state_dict and add
    ``exported["master_weights"] = {param index: fp32 master}`` for every parameter whose
    policy keeps master weights. A plain optimizer loads the state; the masters go into an fp32
    model (see :func:`master_state_dict`)."""
    masters = {}
    for p, info in engine.param_infos():  # the live groups, in checkpoint order
        entry = exported["state"].get(info.index)
        if entry is not None:
            entry.pop(MASTER_KEY, None)
        if p.dtype == torch.bfloat16 and engine.policy.master_codec(info) is not None:
            masters[info.index] = master_of(engine, p).to(device)
    if masters:
        exported[EXPORT_KEY] = masters
    return exported


def master_state_dict(model: torch.nn.Module, optimizer) -> Dict[str, torch.Tensor]:
    """``model.state_dict()`` with every parameter the optimizer keeps master weights for
    replaced by its fp32 master: loadable into an fp32 copy of the model."""
    engine = optimizer._engine
    engine.sync_transfers()
    names = {id(p): n for n, p in model.named_parameters()}
    out = dict(model.state_dict())
    for p, info in engine.param_infos():
        name = names.get(id(p))
        if name is not None and p.dtype == torch.bfloat16 and engine.policy.master_codec(info) is not None:
            out[name] = master_of(engine, p)
    return out


def prepare_load(engine, param_groups, state_dict: dict):
    """Validate and take out the ``master_weights`` entry (nothing changes yet) and keep the
    loaded float state of master-weight parameters in fp32 (torch would cast it to bf16).
    Returns ``(state_dict to load, what :func:`apply_masters` applies after the load)``."""
    params = [p for g in param_groups for p in g["params"]]
    state_dict = dict(state_dict)
    masters = state_dict.pop(EXPORT_KEY, None) or {}
    if not isinstance(masters, dict):
        raise ValueError(f"state_dict: {EXPORT_KEY!r} must map parameter indices to fp32 tensors")
    out = {}
    for index, master in masters.items():
        if not isinstance(index, int) or not 0 <= index < len(params):
            raise ValueError(f"state_dict: {EXPORT_KEY!r} has an entry for unknown parameter index {index!r}")
        p = params[index]
        if not isinstance(master, torch.Tensor) or not master.is_floating_point() or master.shape != p.shape:
            raise ValueError(f"state_dict: {EXPORT_KEY!r}[{index}] must be a float tensor of shape {tuple(p.shape)}")
        out[p] = master
    keep = {}  # saved id -> parameter, for parameters that keep master weights
    for p, info in engine.param_infos():
        if p.dtype == torch.bfloat16 and engine.policy.master_codec(info) is not None:
            keep[info.index] = p
    fp32_state = {}
    if keep and isinstance(state_dict.get("state"), dict):
        for pid, entry in state_dict["state"].items():
            if pid in keep and isinstance(entry, dict):
                p = keep[pid]
                for k, v in entry.items():
                    if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim() > 0 \
                            and v.numel() == p.numel() and k != MASTER_KEY:
                        fp32_state[(p, k)] = v
    return state_dict, (out, fp32_state)


def apply_masters(engine, loaded) -> None:
    """After a load: plain float state of master-weight parameters is kept in fp32 (torch's
    loader casts it to the parameter's bf16); each parameter in ``master_weights`` takes its
    master's bf16 part, its state the correction."""
    masters, fp32_state = loaded
    if not masters and not fp32_state:
        return
    with torch.no_grad():
        for (p, key), value in fp32_state.items():
            engine.state[p][key] = value.detach().to(p.device, torch.float32).reshape(p.shape).clone()
        for p, master in masters.items():
            master = master.to(p.device, torch.float32)
            if p.dtype == torch.bfloat16:
                low, correction = split(master)
                p.copy_(low)
                engine.state[p][MASTER_KEY] = correction
                forget_seed(p)
            else:
                p.copy_(master)
        engine.conform(list(masters) + [p for p, _ in fp32_state])
