"""schedulefree's ``AdamWScheduleFree`` in train mode on the fused path: ``kernels/schedule_free.py``.

Its group values advance once per step on the host (``step/schedule_free.py``); the launch reads
each group's scalars from ``KernelLauncher.group_scalars``.
"""
from __future__ import annotations

from ...state.codecs import StateKind
from ..schedule_free import is_schedule_free_adamw
from .base import MOMENT_FORMS, FusedOptimizer


class ScheduleFreeAdamW(FusedOptimizer):
    """The iterate ``z`` (fp32, bf16 or fp24) and the second moment; a float lr only."""

    name = "schedule_free"
    keys = ("z", "exp_avg_sq")
    tensor_lr = False
    forms = (frozenset({StateKind.FP32, StateKind.BF16, StateKind.FP24}), MOMENT_FORMS)

    def matches(self, inner) -> bool:
        return is_schedule_free_adamw(inner)

    def kernel(self):
        from ..kernels.schedule_free import schedule_free_adamw_kernel
        return schedule_free_adamw_kernel

    def arguments(self, launcher, bucket, launch):
        plan = bucket.plan
        v_codec = plan.codecs[1]
        V, VS = launch.state(1)
        sc = launcher.group_scalars[bucket.group_index]
        args = (*launch.heads, V, VS, *launch.tail, sc["lr"], sc["ckp1"], sc["y_coef"], sc["bias_correction2"],
                sc["eps"], sc["beta2"], sc["one_minus_beta2"], sc["decay"], *launch.codec_tables(v_codec))
        return args, dict(Z_KIND=int(plan.kinds[0]), **launch.codec_constexprs("V", v_codec, plan.kinds[1]),
                          DECAY=sc["decay"] != 0, SMALL_WEIGHT=abs(sc["ckp1"]) < 0.5,
                          **launch.common_without("LR_TENSOR", "MAXIMIZE"))


ENTRY = ScheduleFreeAdamW()
