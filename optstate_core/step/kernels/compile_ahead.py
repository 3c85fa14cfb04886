"""Compile Triton kernel variants on a thread before the launches that need them.

On a fresh machine Triton compiles each kernel variant at its first launch: for the 8B recipe
about 3.5 s of the first step and 1.7 s of the second (docs/benchmarks-journal.md sections 30 and 33). Two
kinds of variant are known before they are needed:

* at wrap(), the step-count kernels of the first step (``advance_steps_kernel`` and both
  ``bias_corrections_kernel`` variants): their arguments do not depend on the model, and the
  process's first compile also pays Triton's own start-up;
* at a first-step launch of an update kernel (``FIRST=True``), its later-step twin: the same
  arguments with ``FIRST=False``. It compiles while the first step runs: the second step no longer
  compiles (2.1 s -> 0.5 s for the 8B recipe with Triton's cache empty), and the first step is
  unchanged within its spread; compiling the twins only from the first step's end left both
  steps as slow as without (docs/benchmarks-journal.md section 33).

One worker thread compiles them (``JITFunction.warmup``: compiled and cached, not launched) and
loads each (``CompiledKernel._init_handles``: the module loaded into the CUDA context and, in Triton
3.6, the launcher built, a C module gcc compiles per variant; otherwise the first launch does both);
a launch that needs a variant still compiling waits for it instead of compiling it twice. Only on
CUDA, not under ``TRITON_INTERPRET=1``. ``tuning.compile_ahead=False`` (``OPTSTATE_COMPILE_AHEAD=0``)
turns it off. With the update kernels compiled for any tensor count (``kernels/common.py:
UNSPECIALIZED``) the 8B recipe's first step compiles one update-kernel variant, 3.7 s with Triton's cache empty (section 34).
"""
from __future__ import annotations

import concurrent.futures
import functools
import logging
import threading
import time
from typing import Dict, FrozenSet, Hashable, Optional, Set

import torch

from . import interpreting

log = logging.getLogger("optstate")

_LOCK = threading.Lock()
_POOL: Optional[concurrent.futures.ThreadPoolExecutor] = None
_PENDING: Dict[Hashable, concurrent.futures.Future] = {}  # variant key -> its compile (kept when done)
_ACTIVE: Set[concurrent.futures.Future] = set()  # compiles not done yet
_STATS = {"compiled": 0, "failed": 0, "seconds": 0.0, "waits": 0}  # this process's compiles ahead


def enabled(wanted: bool = True) -> bool:
    """Whether to compile ahead: ``wanted`` (the option ``tuning.compile_ahead``), and not under
    ``TRITON_INTERPRET=1`` (nothing is compiled there)."""
    return wanted and not interpreting()


def submit(key: Hashable, kernel, args: tuple, kwargs: dict, device: torch.device) -> Optional[concurrent.futures.Future]:
    """Compile ``kernel`` for ``args``/``kwargs`` on ``device`` on the worker thread, once per ``key``
    (a variant: whatever decides Triton's specialization). Returns its future, or None when the
    key was submitted before."""
    global _POOL
    with _LOCK:
        if key in _PENDING:
            return None
        if _POOL is None:
            _POOL = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="optstate-compile-ahead")
        future = _PENDING[key] = _POOL.submit(_compile, kernel, args, kwargs, device)
        _ACTIVE.add(future)
    future.add_done_callback(_ACTIVE.discard)
    return future


def busy() -> bool:
    """Whether any compile is queued or running (a launch only then looks its variant up)."""
    return bool(_ACTIVE)


def _compile(kernel, args: tuple, kwargs: dict, device: torch.device) -> bool:
    t0 = time.perf_counter()
    try:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        compiled = kernel.warmup(*args, grid=(1,), **kwargs)
        load = getattr(compiled, "_init_handles", None)
        if load is not None:  # the module loaded and its launcher built here, not at the first launch
            load()
        _STATS["compiled"] += 1
        return True
    except Exception as exc:  # noqa: BLE001 - the launch compiles it then, as without compiling ahead
        _STATS["failed"] += 1
        log.info("optstate: compiling %s ahead failed (%s); its launch compiles it", getattr(kernel, "__name__", kernel),
                 exc)
        return False
    finally:
        _STATS["seconds"] += time.perf_counter() - t0


def stats() -> dict:
    """This process's compiles ahead: done, failed, seconds on the worker, launches that waited."""
    return dict(_STATS)


def wait_for(key: Hashable) -> None:
    """Before a launch of variant ``key``: wait while the worker is compiling it (then the launch
    finds it in Triton's cache)."""
    future = _PENDING.get(key)
    if future is not None and not future.done():
        _STATS["waits"] += 1
        future.result()


def variant_key(kernel, args: tuple, kwargs: dict) -> tuple:
    """A launch's variant, as Triton tells variants apart: per argument its dtype (tensors); for an
    integer whether it needs 64 bits, equals 1 and divides by 16, or only its width where the
    kernel does not specialize on it (``do_not_specialize``); floats only as floats; constexprs and
    launch options by value. Pointer alignment is not looked at: every table is 16-byte aligned."""
    names, fixed = getattr(kernel, "arg_names", ()), unspecialized(kernel)

    def part(name, v):
        if isinstance(v, torch.Tensor):
            return ("tensor", v.dtype)
        if isinstance(v, int) and not isinstance(v, bool):
            wide = not -2**31 <= v < 2**31
            return ("int", wide) if name in fixed else ("int", wide, v == 1, v % 16 == 0)
        return "float" if isinstance(v, float) else v
    return (id(kernel), tuple(part(names[i] if i < len(names) else i, v) for i, v in enumerate(args)),
            tuple(sorted((k, part(k, v)) for k, v in kwargs.items())))


@functools.lru_cache(maxsize=None)
def unspecialized(kernel) -> FrozenSet[str]:
    """Names of ``kernel``'s arguments compiled without specializing on their value (its
    ``do_not_specialize``, compiled or interpreted); read once per kernel."""
    listed = getattr(kernel, "do_not_specialize", None)
    if listed is None:
        listed = getattr(kernel, "kwargs", {}).get("do_not_specialize")
    names = getattr(kernel, "arg_names", ())
    return frozenset(names[a] if isinstance(a, int) and a < len(names) else a for a in (listed or ()))


def twin(kernel, args: tuple, kwargs: dict, device: torch.device) -> None:
    """After a first-step launch: compile its later-step twin (``FIRST=False``) ahead."""
    later = {**kwargs, "FIRST": False}
    submit(variant_key(kernel, args, later), kernel, args, later, device)


def first_step_variants(inner, device: torch.device) -> list:
    """``(kernel, args, kwargs)`` of the step-count kernels a first step launches on ``device``
    (stand-in tensors of the launches' dtypes: a pointer table, the corrections, the flags or the
    learning-rate tensor)."""
    from .adam import advance_steps_kernel, bias_corrections_kernel

    steps = torch.zeros(16, dtype=torch.int64, device=device)
    corr = torch.zeros(48, dtype=torch.float32, device=device)
    flags = torch.zeros(16, dtype=torch.int32, device=device)  # the launch passes its flags as lr_ptr
    out = [(advance_steps_kernel, (steps,), {})]
    for lr in {g["lr"].dtype if isinstance(g["lr"], torch.Tensor) else None for g in inner.param_groups}:
        lr_ptr = flags if lr is None else torch.zeros(1, dtype=lr, device=device)
        out += [(bias_corrections_kernel, (steps, corr, lr_ptr, 0.0, -0.1, -0.001),
                 dict(LR_TENSOR=lr is not None, ADVANCE=advance, STEP_ONLY=False)) for advance in (True, False)]
    return out


def start(inner) -> None:
    """At wrap(), when the fused path may run and compiling ahead is on: compile the first step's
    step-count kernels for each CUDA device of ``inner``'s parameters."""
    for device in {p.device for g in inner.param_groups for p in g["params"] if p.device.type == "cuda"}:
        for kernel, args, kwargs in first_step_variants(inner, device):
            submit(variant_key(kernel, args, kwargs), kernel, args, kwargs, device)
