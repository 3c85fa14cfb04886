"""lion-pytorch's ``Lion`` on the fused path: ``kernels/lion.py`` on its momentum."""
from __future__ import annotations

from ..granularity import qualified_name
from .base import FusedOptimizer


def is_lion(inner) -> bool:
    """lion-pytorch's ``Lion`` with its own (torch) update function, which the Lion kernel reproduces."""
    if qualified_name(type(inner)) != "lion_pytorch.lion_pytorch.Lion":
        return False
    update = getattr(inner, "update_fn", None)
    return getattr(update, "__module__", None) == "lion_pytorch.lion_pytorch" and update.__name__ == "update_fn"


class Lion(FusedOptimizer):
    """lion-pytorch's ``Lion`` (its decoupled weight decay too); a float lr only."""

    name = "lion"
    keys = ("exp_avg",)
    tensor_lr = False

    def matches(self, inner) -> bool:
        return is_lion(inner)

    def kernel(self):
        from ..kernels.lion import lion_kernel
        return lion_kernel

    def arguments(self, launcher, bucket, launch):
        group, m_codec, inner = launch.group, bucket.plan.codecs[0], launcher.ctx.inner
        beta1, beta2 = (float(b) for b in group["betas"])
        wd = float(group["weight_decay"])
        if getattr(inner, "decoupled_wd", False):
            wd /= inner._init_lr
        lr = launch.lr_val
        args = (*launch.heads, *launch.tail, 1.0 - lr * wd, lr, beta1, beta2, 1.0 - beta1, 1.0 - beta2,  # in float64
                *launch.codec_tables(m_codec))  # on the host, as lion-pytorch
        return args, dict(**launch.codec_constexprs("M", m_codec, bucket.plan.kinds[0]),
                          **launch.common_without("LR_TENSOR", "MAXIMIZE"))


ENTRY = Lion()
