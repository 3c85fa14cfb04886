"""The fused path of schedule-free AdamW: its group values on the host, its parameters in the kernels.

``AdamWScheduleFree`` keeps values in its groups (``k``, ``lr_max``, ``weight_sum``) that change once
per step, so it is wrapped with granularity ``"step"``. When every parameter with a gradient can go
to the kernel (``kernels/schedule_free.py``), the step is: the group values advanced exactly as the
optimizer's ``step`` advances them (written into the real group dicts), then one launch per bucket
with each group's scalars; the buckets are reused while nothing they depend on changes (the
engine's plan cache). Otherwise (the lossless preset, offloaded state, a codec switch, master
weights, eval mode) the whole step runs through the optimizer itself (:func:`step.session.run_whole_step`).
"""
from __future__ import annotations

from typing import Dict, List, Optional, TYPE_CHECKING

from ..state.codecs.kinds import StateKind
from .context import Residency, StepContext
from .gradients import collect
from .granularity import qualified_name

if TYPE_CHECKING:  # annotations only
    from .fused import FusedPath

SCHEDULE_FREE_ADAMW = "schedulefree.adamw_schedulefree.AdamWScheduleFree"


def is_schedule_free_adamw(inner) -> bool:
    return qualified_name(type(inner)) == SCHEDULE_FREE_ADAMW


def advance_groups(inner) -> Dict[int, dict]:
    """Advance every group's schedule-free values for this step as ``AdamWScheduleFree.step`` does
    (in the same float64 arithmetic) and return each group's kernel scalars."""
    scalars = {}
    for gi, group in enumerate(inner.param_groups):
        beta1, beta2 = group["betas"]
        k, warmup = group["k"], group["warmup_steps"]
        sched = (k + 1) / warmup if k < warmup else 1.0
        bias_correction2 = 1 - beta2 ** (k + 1)
        lr = group["lr"] * sched
        group["scheduled_lr"] = lr
        lr_max = group["lr_max"] = max(lr, group["lr_max"])
        weight = ((k + 1) ** group["r"]) * (lr_max ** group["weight_lr_power"])
        weight_sum = group["weight_sum"] = group["weight_sum"] + weight
        try:
            ckp1 = weight / weight_sum
        except ZeroDivisionError:
            ckp1 = 0
        group["k"] = k + 1
        scalars[gi] = dict(lr=lr, ckp1=ckp1, y_coef=lr * (beta1 * (1 - ckp1) - 1),
                           bias_correction2=bias_correction2, eps=group["eps"], beta2=beta2,
                           one_minus_beta2=1 - beta2, decay=group["weight_decay"])
    return scalars


def fused_step_applies(inner, fused: FusedPath) -> bool:
    """Whether the optimizer is schedule-free AdamW in train mode and the kernels may run (in eval
    mode its own step raises its "not in train mode" error)."""
    return is_schedule_free_adamw(inner) and fused.mode is not False and \
        all(g["train_mode"] for g in inner.param_groups)


def plan_fused_step(ctx: StepContext, residency: Residency, fused: FusedPath) -> Optional[List]:
    """The buckets of a fused schedule-free step, or None when some parameter with a gradient cannot
    go to the kernel (the whole step then runs through the optimizer; nothing changed here)."""
    works = collect(ctx.param_infos(), ctx.store)
    residency.assign_residency(works, ctx.step_count)
    planned = []
    for w in works:
        plan = fused.plan(w) or fused.takes_uncompressed(w, beside=True)
        if plan is None or plan.offload or plan.kind != "schedule_free":
            return None
        planned.append((w, plan))
    if not any(any(k != StateKind.FP32 for k in plan.kinds) for _, plan in planned):
        return None  # nothing compressed: the optimizer's own step is exact and fast
    return fused.build(planned)
