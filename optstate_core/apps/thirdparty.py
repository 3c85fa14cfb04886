"""Third-party optimizers for ``optstate compat --thirdparty``: discovery, factories and settings on the compat task."""
from __future__ import annotations

import importlib
import inspect
import logging
import math
from dataclasses import dataclass, field
from importlib import metadata
from typing import Callable, Dict, List, Optional, Sequence

import torch

log = logging.getLogger("optstate.compat")

#: importable module -> distribution name (for the versions the page lists), in table order
PACKAGES: Dict[str, str] = {
    "schedulefree": "schedulefree", "prodigyopt": "prodigyopt", "lion_pytorch": "lion-pytorch",
    "came_pytorch": "came-pytorch", "optimi": "torch-optimi", "heavyball": "heavyball", "adam_mini": "adam-mini",
    "pytorch_optimizer": "pytorch-optimizer",
}
#: classes of schedulefree named here (the ``*Closure``/``*Reference``/``*Paper`` variants are left out:
#: closure-driven or reference copies of the same update)
SCHEDULEFREE = ("AdamWScheduleFree", "SGDScheduleFree", "RAdamScheduleFree")
#: ``package:Class`` -> options that train the compat task in its step count (the rest use the class defaults,
#: with lr=1e-3 where the class has no default lr)
SETTINGS: Dict[str, dict] = {
    "came_pytorch:CAME": dict(lr=2e-4),
    "optimi:SGD": dict(lr=0.05, momentum=0.9),
    "optimi:StableAdamW": dict(lr=1e-3, triton=False),
    "heavyball:SGD": dict(lr=0.05),
    "heavyball:UnscaledAdamW": dict(lr=0.1),
    "heavyball:ADOPT": dict(lr=1e-3, eps=1e-6),  # eps=1e-8 gives NaN on this task
    "heavyball:QSGD": dict(lr=0.05),
    "pytorch_optimizer:AccSGD": dict(lr=0.5),
    "pytorch_optimizer:Adai": dict(lr=0.5),
    "pytorch_optimizer:AdaMod": dict(lr=3e-3, betas=(0.9, 0.999, 0.99)),
    "pytorch_optimizer:AdamMini": dict(lr=3e-3, weight_decay=0.0),
    "pytorch_optimizer:AggMo": dict(lr=0.05),
    "pytorch_optimizer:ASGD": dict(lr=1.0),
    "pytorch_optimizer:DAdaptAdan": dict(lr=1.0, growth_rate=1.02),  # unbounded growth diverges here
    "pytorch_optimizer:FOCUS": dict(lr=1e-3),
    "pytorch_optimizer:Gravity": dict(lr=0.5),
    "pytorch_optimizer:GrokFastAdamW": dict(lr=1e-3),
    "pytorch_optimizer:Kate": dict(lr=1e-5),
    "pytorch_optimizer:LARS": dict(lr=5.0),
    "pytorch_optimizer:LoRARite": dict(lr=3e-3),
    "pytorch_optimizer:MSVAG": dict(lr=0.2),
    "pytorch_optimizer:PID": dict(lr=0.05, momentum=0.9),
    "pytorch_optimizer:PNM": dict(lr=0.2),
    "pytorch_optimizer:QHM": dict(lr=0.2, momentum=0.9, nu=0.7),
    "pytorch_optimizer:Ranger21": dict(num_iterations=200),  # its warmup/warmdown schedule spans compat's default steps
    "pytorch_optimizer:SaRA": dict(lr=1e-2),
    "pytorch_optimizer:ScalableShampoo": dict(lr=3e-2),
    "pytorch_optimizer:SGDP": dict(lr=0.05, momentum=0.9),
    "pytorch_optimizer:SGDW": dict(lr=0.05, momentum=0.9),
    "pytorch_optimizer:Shampoo": dict(lr=3e-2),
    "pytorch_optimizer:SimplifiedAdEMAMix": dict(lr=1e-3),
    "pytorch_optimizer:SM3": dict(lr=0.1, momentum=0.9),
    # its bisection solves up to 100 matrix signs per matrix per step: 10 s a step on a 2-core AMD CPU
    "pytorch_optimizer:SpectralSphere": dict(lr=1e-2, solver_max_iterations=8),
    "pytorch_optimizer:SRMM": dict(lr=0.5),
    "pytorch_optimizer:TAM": dict(lr=0.05),
    "pytorch_optimizer:VSGD": dict(lr=0.01),
}
#: ``package:Class`` -> why it is listed but not run (what it needs that the task and a plain ``step()`` lack)
KNOWN_SKIPS: Dict[str, str] = {
    "pytorch_optimizer:AdaHessian": "second order: needs loss.backward(create_graph=True) (Hessian-vector products)",
    "pytorch_optimizer:SophiaH": "second order: needs loss.backward(create_graph=True) (Hessian-vector products)",
    "pytorch_optimizer:AliG": "needs a closure returning the loss (its step size uses the loss value)",
    "pytorch_optimizer:BSAM": "sharpness-aware: needs a closure (two gradient evaluations per step) and num_data",
    "pytorch_optimizer:LOMO": "fuses the update into backward (takes the model, optimizer.grad_norm/fused_backward; "
                              "no plain step())",
    "pytorch_optimizer:AdaLOMO": "fuses the update into backward (takes the model, optimizer.grad_norm/fused_backward; "
                                 "no plain step())",
    "pytorch_optimizer:DistributedMuon": "needs an initialized torch.distributed process group",
    "heavyball:SAMWrapper": "sharpness-aware wrapper around another optimizer: needs a closure",
    "heavyball:SplitOpt": "dispatches parameter groups to other optimizers given as specs: not an optimizer of its own",
}
#: pytorch_optimizer's Muon family: parameter groups flagged ``use_muon`` (hidden matrices) or not (the rest, AdamW)
MUON_FAMILY = {"Muon", "AdaMuon", "AdaGO", "NorMuon", "MuonClip"}
#: the probe's steps at discovery (construct and step without a closure, on the task's model)
PROBE_STEPS = 2
#: a third-party optimizer trains the task when every seed's held-out loss ends below this share of the initial one
TRAINS = 0.8


@dataclass
class Entry:
    """One third-party optimizer: ``factory(model)`` builds it on the task's model, unless ``skip`` says why not."""
    name: str
    factory: Optional[Callable[[torch.nn.Module], torch.optim.Optimizer]] = None
    skip: Optional[str] = None
    bias: bool = True
    options: dict = field(default_factory=dict)


def versions() -> Dict[str, Optional[str]]:
    """Installed version of each package of :data:`PACKAGES` (None: not installed)."""
    out = {}
    for dist in PACKAGES.values():
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def _optimizer_classes(module, names: Optional[Sequence[str]] = None) -> List[type]:
    """The optimizer classes a module exports (its ``__all__`` when it has one), or those of ``names`` present."""
    if names is None:
        names = getattr(module, "__all__", None) or [n for n in vars(module) if not n.startswith("_")]
    found = []
    for n in names:
        obj = getattr(module, n, None)
        if isinstance(obj, type) and issubclass(obj, torch.optim.Optimizer) and obj not in found:
            found.append(obj)
    return found


def _settings(name: str, cls: type) -> dict:
    """The options for ``cls``: :data:`SETTINGS` of ``name``, else lr=1e-3 where the class has no default lr."""
    if name in SETTINGS:
        return dict(SETTINGS[name])
    lr = inspect.signature(cls.__init__).parameters.get("lr")
    return {"lr": 1e-3} if lr is not None and lr.default in (inspect.Parameter.empty, None) else {}


def _plain_factory(cls: type, options: dict) -> Callable:
    """``cls(model.parameters(), **options)``."""
    def factory(model):
        return cls(model.parameters(), **options)
    return factory


def _adam_mini_factory(cls: type, options: dict) -> Callable:
    """Adam-mini on the MLP: named parameters, one head of the widest hidden size (no attention blocks)."""
    def factory(model):
        dim = max(p.shape[0] for p in model.parameters())
        return cls(model.named_parameters(), dim=dim, n_heads=1, verbose=False, **options)
    return factory


def _muon_groups_factory(cls: type, options: dict) -> Callable:
    """A pytorch_optimizer Muon-family optimizer: the hidden weight matrices flagged ``use_muon``, the output
    layer and the biases in an AdamW group (lr 3e-3)."""
    def factory(model):
        linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
        hidden = [m.weight for m in linears[:-1]]
        rest = [p for p in model.parameters() if all(p is not h for h in hidden)]
        return cls([dict(params=hidden, use_muon=True), dict(params=rest, use_muon=False, lr=3e-3)], **options)
    return factory


def _model_factory(cls: type, options: dict) -> Callable:
    """``cls(model, **options)``: an optimizer that takes the model itself (pytorch_optimizer's AdamMini)."""
    def factory(model):
        return cls(model, **options)
    return factory


def _candidates() -> List[Entry]:
    """Every optimizer class of the installed packages, with its factory (not yet probed)."""
    entries: List[Entry] = []
    torch_classes = {obj for obj in vars(torch.optim).values() if isinstance(obj, type)}

    def add(module_name: str, cls: type, make=_plain_factory, display: Optional[str] = None, bias: bool = True):
        name = f"{module_name}:{display or cls.__name__}"
        if any(e.name == name for e in entries):
            return
        if cls in torch_classes:
            entries.append(Entry(name, skip=f"is torch.optim.{cls.__name__} (see docs/compatibility.md)"))
            return
        if name in KNOWN_SKIPS:
            entries.append(Entry(name, skip=KNOWN_SKIPS[name]))
            return
        options = _settings(name, cls)
        entries.append(Entry(name, make(cls, options), bias=bias, options=options))

    for module_name in PACKAGES:
        try:
            module = importlib.import_module(module_name)
        except Exception as e:  # not installed, or its import fails with this torch
            log.info("compat: %s not importable (%s: %s)", module_name, type(e).__name__, e)
            continue
        if module_name == "schedulefree":
            classes = _optimizer_classes(module, SCHEDULEFREE)
        else:
            classes = _optimizer_classes(module)
        if module_name == "heavyball":
            module.utils.compile_mode = None  # eager: torch.compile of its steps on CPU costs minutes per class
        if module_name == "adam_mini":
            for cls in classes:
                add(module_name, cls, _adam_mini_factory)
        elif module_name == "pytorch_optimizer":
            for key in module.get_supported_optimizers():
                try:
                    cls = module.load_optimizer(key)
                except Exception as e:
                    entries.append(Entry(f"pytorch_optimizer:{key}", skip=f"load_optimizer fails: {type(e).__name__}: {e}"))
                    continue
                if cls.__name__ in MUON_FAMILY:
                    add(module_name, cls, _muon_groups_factory)
                elif cls.__name__ == "AdamMini":
                    add(module_name, cls, _model_factory)
                else:  # SpectralSphere takes matrices only: the model without biases, as Muon's row of compat
                    add(module_name, cls, bias=cls.__name__ != "SpectralSphere")
        else:
            for cls in classes:
                add(module_name, cls)
    return entries


def _probe(entry: Entry) -> Optional[str]:
    """Why ``entry`` cannot run the task (construction or a plain ``step()`` without a closure fails, or gives
    non-finite weights), else None."""
    from .compat_task import BATCH, task
    model, (x, y), _, _ = task(0, bias=entry.bias)
    try:
        opt = entry.factory(model)
    except Exception as e:
        return f"cannot be built for the MLP: {type(e).__name__}: {one_line(e, 200)}"
    try:
        if callable(getattr(opt, "train", None)):
            opt.train()
        for i in range(PROBE_STEPS):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x[i * BATCH:(i + 1) * BATCH]), y[i * BATCH:(i + 1) * BATCH]).backward()
            opt.step()
    except Exception as e:
        return f"a plain step() fails: {type(e).__name__}: {one_line(e, 200)}"
    if not all(torch.isfinite(p).all() for p in model.parameters()):
        return "non-finite weights after a plain step()"
    return None


def one_line(text, limit: Optional[int] = None) -> str:
    """The first line of a reason or an exception's message, safe inside a markdown table cell."""
    lines = str(text).strip().splitlines()
    return (lines[0] if lines else "").replace("|", "/")[:limit]


def discover(names: Optional[Sequence[str]] = None, probe: bool = True) -> List[Entry]:
    """The third-party optimizers (those of ``names`` when given, as ``package:Class``): each with a factory,
    or a ``skip`` reason when it cannot be built or stepped plainly on the task. Raises ValueError for a name
    that is not discovered."""
    entries = _candidates()
    if names is not None:
        known = {e.name: e for e in entries}
        unknown = [n for n in names if n not in known]
        if unknown:
            raise ValueError(f"--optimizers: {', '.join(unknown)} not found among the installed third-party "
                             f"optimizers (known: {', '.join(sorted(known))})")
        entries = [known[n] for n in names]
    if probe:
        for entry in entries:
            if entry.skip is None:
                entry.skip = _probe(entry)
                if entry.skip is not None:
                    entry.factory = None
    return entries


def not_training(initials: Sequence[float], losses: Sequence[float]) -> Optional[str]:
    """Why the unwrapped held-out losses (one per seed, against the initial ones) do not show the task
    trained, else None."""
    for seed, (initial, loss) in enumerate(zip(initials, losses)):
        if not math.isfinite(loss):
            return f"unwrapped held-out loss is {loss} (seed {seed})"
        if loss > TRAINS * initial:
            return (f"does not train the task unwrapped with these settings: held-out loss {loss:.4f} "
                    f"vs {initial:.4f} initially (seed {seed})")
    return None
