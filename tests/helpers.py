"""Small models and data shared by the tests (CPU, seeded, no downloads)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import torch


def mlp(seed: int = 0, width: int = 64, depth: int = 2, n_in: int = 32, n_out: int = 8) -> torch.nn.Module:
    torch.manual_seed(seed)
    layers, d = [], n_in
    for _ in range(depth):
        layers += [torch.nn.Linear(d, width), torch.nn.GELU()]
        d = width
    layers.append(torch.nn.Linear(d, n_out))
    return torch.nn.Sequential(*layers)


def batch(seed: int = 1, n: int = 64, n_in: int = 32, n_out: int = 8):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, n_in, generator=g), torch.randint(0, n_out, (n,), generator=g)


def train_steps(model, opt, steps: int, seed: int = 1, closure: bool = False):
    """Train on a fixed stream of batches (cast to the parameters' dtype, e.g. after cast_model);
    returns the list of losses."""
    losses = []
    first = next(model.parameters())
    for s in range(steps):
        x, y = batch(seed + s)
        x, y = x.to(first.device, first.dtype), y.to(first.device)

        def fn():
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x).float(), y)
            loss.backward()
            return loss

        if closure:
            loss = opt.step(fn)
        else:
            loss = fn()
            opt.step()
        losses.append(float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss))
    return losses


def flat_params(model) -> torch.Tensor:
    """All parameters of a module (or a list of tensors) as one flat float tensor."""
    params = model.parameters() if isinstance(model, torch.nn.Module) else model
    return torch.cat([p.detach().reshape(-1).float() for p in params])


def two_groups(model, lr=1e-3, wd=0.1):
    """Weight matrices with weight decay, biases without (HF-Trainer-like grouping)."""
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0, "lr": lr * 2}]


def bf16_param_list(shapes, seed: int = 0, device="cpu") -> torch.nn.ParameterList:
    """Random parameters of ``shapes`` (scale 0.5), cast to bf16 by ``cast_model`` (their fp32
    remainders seed the master weights)."""
    from optstate_core import cast_model

    g = torch.Generator().manual_seed(seed)
    m = torch.nn.ParameterList([torch.nn.Parameter((torch.randn(s, generator=g) * 0.5).to(device)) for s in shapes])
    cast_model(m)
    return m


def same_up_to_rounding_flips(diff: torch.Tensor, tol: float = 1e-5, bound: float = 2e-3) -> bool:
    """Whether parameters of a distributed run and of its one-process reference (``diff``: their
    absolute differences) agree but for rounding flips. Both sum the same gradients in another
    order (~1e-7 apart); where that moves a value across an int8 stochastic-rounding threshold
    its code differs by one step, which moves that parameter by up to ~lr/25 over a few steps.
    So: all but a handful (0.5%) agree to ``tol``, and none differs by ``bound`` or more (a wrong
    accumulation or a missed all-reduce moves most parameters by ~lr)."""
    return int((diff > tol).sum()) <= max(3, diff.numel() // 200) and float(diff.max()) < bound


def capture_step(step, warm=None):
    """A CUDA graph of ``step()`` (not run at capture), after ``warm()`` (default: ``step``) ran
    once on a side stream, as torch's capture recipe asks (pointer tables and caches warmed)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        (warm or step)()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph


def steps_without_host_sync(model, opt, x, warmup: int = 3, steps: int = 2) -> None:
    """Training steps (forward, backward, ``opt.step()``, ``zero_grad``) on ``x``: ``warmup`` to
    build the plans, then ``steps`` under CUDA's sync debug mode, which raises on any host
    synchronisation."""
    def train_step():
        model(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    for _ in range(warmup):
        train_step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(steps):
            train_step()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def load_tool(name: str):
    """The module of ``tools/<name>.py`` (the tools are scripts, not a package)."""
    path = Path(__file__).resolve().parents[1] / "tools" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def local_tensors(tree, prefix=""):
    """Every tensor of a nested state dict (lists, dicts, DTensors as their local shard), by path,
    detached on the CPU and cloned."""
    if isinstance(tree, torch.Tensor):
        return {prefix: getattr(tree, "_local_tensor", tree).detach().cpu().clone()}
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in local_tensors(sub, f"{prefix}/{key}").items()}
    if isinstance(tree, (list, tuple)):
        return {k: v for i, sub in enumerate(tree) for k, v in local_tensors(sub, f"{prefix}/{i}").items()}
    return {}


def recording_arena(slab_bytes=None):
    """A pinned arena over ordinary host memory (the suite has no CUDA) that records the byte sizes
    of the allocations it makes (``.asked``); ``slab_bytes`` as :class:`PinnedArena`'s (None: its default)."""
    from optstate_core.state.pinned import DEFAULT_SLAB_BYTES, PinnedArena

    class RecordingArena(PinnedArena):
        def __init__(self):
            super().__init__(slab_bytes=DEFAULT_SLAB_BYTES if slab_bytes is None else slab_bytes, pin=False)
            self.asked = []

        def _bytes(self, nbytes):
            self.asked.append(nbytes)
            return super()._bytes(nbytes)

    return RecordingArena()


def use_arena(opt, arena):
    """Give a wrapped optimizer ``arena`` as its pinned arena (ending what wrap() pinned ahead)."""
    opt._engine.pinned.end_ahead()
    opt._engine.use_pinned_arena(arena)
    return arena
