"""Triton kernels, each beside its reference twin and tested against it (``tests/kernels``).

* ``codec_ops.py``  decode/encode of state tiles (twins: ``optstate_core/state/codecs``)
* ``common.py``     what every update kernel shares: tiles, parameters and gradients, NaN/inf skips
* ``adam.py``       fused Adam/AdamW step (twin: the engine's tiled path with torch.optim.Adam;
                    with TORCH_FUSED, torch's own fused CUDA Adam(W), tests/gpu/test_torch_fused_exact.py)
* ``sgd.py``        fused SGD-with-momentum step (twin: tiled path with torch.optim.SGD)
* ``lion.py``       fused Lion step (twin: tiled path with lion-pytorch's Lion)
* ``schedule_free.py`` fused schedule-free AdamW step (twin: the optimizer's own whole step)
* ``launch.py``     pointer tables and work lists
* ``compile_ahead.py`` kernel variants compiled on a thread before their launches (CUDA)

Kernels import nothing from the engine, only the state-kind enum (``state/codecs/kinds.py``). On a
machine without a GPU they run under ``TRITON_INTERPRET=1`` (that is how CI tests them). Which
optimizer launches which kernel, with which arguments: ``step/fused_optimizers/``.
"""
from __future__ import annotations

import functools
import os


@functools.lru_cache(maxsize=None)
def triton_error() -> str:
    """Why Triton kernels cannot run here ('' when they can)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception as e:  # pragma: no cover - depends on the install
        return f"triton is not importable ({e})"
    return ""


def interpreting() -> bool:
    """Whether Triton runs kernels on the CPU through its interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
