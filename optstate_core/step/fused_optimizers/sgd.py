"""SGD with momentum (``torch.optim.SGD``) on the fused path: ``kernels/sgd.py`` on the momentum buffer."""
from __future__ import annotations

import torch

from .base import FusedOptimizer


class SGD(FusedOptimizer):
    """``torch.optim.SGD`` with momentum (dampening, nesterov, maximize, a tensor lr)."""

    name = "sgd"
    keys = ("momentum_buffer",)

    def matches(self, inner) -> bool:
        return type(inner) is torch.optim.SGD  # exactly SGD: a subclass may change the update

    def refusal(self, inner, group):
        return None if group["momentum"] else "SGD without momentum has no state to compress"

    def kernel(self):
        from ..kernels.sgd import sgd_kernel
        return sgd_kernel

    def arguments(self, launcher, bucket, launch):
        group, m_codec = launch.group, bucket.plan.codecs[0]
        args = (*launch.heads, *launch.tail, launch.lr_ptr, launch.lr_val, float(group["momentum"]),
                float(group["dampening"]), float(group["weight_decay"]), *launch.codec_tables(m_codec))
        return args, dict(**launch.codec_constexprs("M", m_codec, bucket.plan.kinds[0]),
                          NESTEROV=bool(group["nesterov"]), **launch.common)


ENTRY = SGD()
