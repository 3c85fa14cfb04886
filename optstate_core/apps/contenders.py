"""The optimizers the capacity and peak-memory benchmarks compare, by name: how each one wants the
model's weights (fp32 + bf16 autocast, or bf16), how it is built, and a rough GPU bytes/param.

Names: ``adamw`` (torch AdamW fused, fp32 weights), ``bnb8`` (bitsandbytes AdamW8bit),
``ao_offload`` (torchao CPUOffloadOptimizer over fused AdamW, gradients offloaded too),
``flashoptim`` (FlashAdamW on bf16 weights; ``flashoptim+release`` with its gradient release),
``none`` / ``none-bf16`` (forward+backward only, each gradient freed in its hook: the activation
baseline), or an optstate preset with optional suffixes ``+offload``, ``+release`` and
``+budget<bytes>`` (``gpu_budget``, e.g. ``+budget3GiB``);
``bf16w-*`` presets get bf16 weights and gradient release unless ``+norelease`` is given.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ..state.units import parse_bytes

THIRD_PARTY = {"adamw", "bnb8", "ao_offload", "flashoptim", "none", "none-bf16"}
LR = 1e-4


@dataclass(frozen=True)
class Contender:
    """One optimizer configuration of a benchmark row."""
    name: str
    weights: torch.dtype  # the model's parameter dtype
    preset: Optional[str] = None  # optstate preset, or None
    offload: bool = False
    release: bool = False
    gpu_budget: Optional[int] = None  # ``+budget<bytes>``: optimizer state kept on the GPU at most

    @property
    def autocast(self) -> bool:
        """fp32 weights train under bf16 autocast (mixed precision); bf16 weights run as they are."""
        return self.weights == torch.float32

    @property
    def base(self) -> str:
        """The name without its suffixes."""
        return self.name.split("+")[0]

    @property
    def has_optimizer(self) -> bool:
        return not self.name.startswith("none")


def parse(name: str) -> Contender:
    """A :class:`Contender` from its name (see the module doc); ValueError names a bad one."""
    from ..presets import PRESET_ALIASES, PRESETS, has_master_weights

    base, *suffixes = name.strip().split("+")
    budget = None
    for suffix in [x for x in suffixes if x.startswith("budget")]:
        budget = parse_bytes(suffix[len("budget"):], f"optimizer {name!r}: +budget")
        suffixes.remove(suffix)
    unknown = set(suffixes) - {"offload", "release", "norelease"}
    if unknown:
        raise ValueError(f"optimizer {name!r}: unknown suffix {sorted(unknown)} (valid: +offload, +release, "
                         "+norelease, +budget<bytes>)")
    if base in THIRD_PARTY:
        if budget is not None:
            raise ValueError(f"optimizer {name!r}: +budget applies to optstate presets only")
        if suffixes and not (base == "flashoptim" and suffixes == ["release"]):
            raise ValueError(f"optimizer {name!r}: suffixes apply to optstate presets (and flashoptim+release) only")
        weights = torch.bfloat16 if base in ("flashoptim", "none-bf16") else torch.float32
        return Contender(name, weights, release=bool(suffixes))
    preset = PRESET_ALIASES.get(base, base)
    if preset not in PRESETS:
        raise ValueError(f"optimizer {name!r}: not one of {', '.join(sorted(THIRD_PARTY))} nor an optstate "
                         f"preset ({', '.join(sorted(PRESETS))})")
    master = has_master_weights(preset)
    release = "release" in suffixes or (master and "norelease" not in suffixes)
    return Contender(name, torch.bfloat16 if master else torch.float32, preset, "offload" in suffixes, release,
                     budget)


def unavailable(c: Contender) -> Optional[str]:
    """Why this contender cannot run here (a missing package), or None."""
    module = {"bnb8": "bitsandbytes", "ao_offload": "torchao.optim", "flashoptim": "flashoptim"}.get(c.base)
    if module is None:
        return None
    try:
        __import__(module)
    except Exception as e:  # not installed, or no build for this machine
        return f"{module} not importable ({type(e).__name__})"
    return None


def build(c: Contender, params, model=None, max_grad_norm=None, **options) -> Optional[torch.optim.Optimizer]:
    """The optimizer over ``params`` (None for the forward+backward-only baselines); ``model``
    for flashoptim's gradient release, which hooks the model; ``max_grad_norm`` and further
    ``wrap()`` keyword ``options`` for optstate's."""
    if not c.has_optimizer:
        return None
    if options and c.preset is None:
        raise ValueError(f"options {sorted(options)} are wrap() options: {c.base} is not an optstate contender")
    fused = params[0].is_cuda or None
    if c.base == "adamw":
        return torch.optim.AdamW(params, lr=LR, fused=fused)
    if c.base == "bnb8":
        import bitsandbytes as bnb
        return bnb.optim.AdamW8bit(params, lr=LR)
    if c.base == "ao_offload":
        from torchao.optim import CPUOffloadOptimizer
        return CPUOffloadOptimizer(params, torch.optim.AdamW, offload_gradients=True, lr=LR, fused=True)
    if c.base == "flashoptim":
        from flashoptim import FlashAdamW, enable_gradient_release
        opt = FlashAdamW(params, lr=LR)
        if c.release:
            opt._optstate_release_handle = enable_gradient_release(model, opt)  # step()/zero_grad() become no-ops
        return opt
    from ..presets import make_policy, wrap
    return wrap(torch.optim.AdamW(params, lr=LR, fused=fused), make_policy(c.preset), offload=c.offload,
                release_gradients=c.release, max_grad_norm=max_grad_norm, gpu_budget=c.gpu_budget, **options)


def free_gradients_in_hooks(params) -> Callable[[], None]:
    """For the baselines: every gradient is dropped as soon as it is accumulated; returns the undo."""
    handles = [p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None)) for p in params]
    return lambda: [h.remove() for h in handles]


def hint_bytes_per_param(c: Contender) -> float:
    """A rough GPU bytes/param (weights + autocast copies + gradients + resident state): only where
    the capacity search starts, never a reported figure."""
    fixed = {"adamw": 18.0, "bnb8": 12.0, "ao_offload": 6.0, "flashoptim": 7.0, "none": 6.0, "none-bf16": 2.0}
    if c.base in fixed:
        return fixed[c.base] - (2.0 if c.release else 0.0)
    from ..state.codecs import get_codec
    from ..presets import PRESETS
    spec = PRESETS[c.preset]
    moment = {"fp32": 4.0, "bf16": 2.0, "int4": 0.5}
    state = 0.0 if c.offload or spec.get("device_resident") is False else \
        sum(moment.get(get_codec(spec.get(k, "int8")).name, 1.0) for k in ("momentum_codec", "variance_codec")) + \
        (0.0 if spec.get("master_tier") == "host" else {"corr16": 2.0, "corr8": 1.0}.get(spec.get("master_correction"), 0.0))
    weights = 2.0 if c.weights == torch.bfloat16 else 6.0  # fp32 weights + their bf16 autocast copies
    grads = 0.0 if c.release else (2.0 if c.weights == torch.bfloat16 else 4.0)
    return weights + grads + state + (0.5 if c.offload else 0.0)
