"""Adam and AdamW (``torch.optim``) on the fused path: ``kernels/adam.py``, master weights, torch's fused arithmetic."""
from __future__ import annotations

import math
from typing import Dict

import torch

from ...state.codecs import StateKind
from ..inner import decoupled_decay
from .base import FusedOptimizer

_BETAS: Dict[tuple, torch.Tensor] = {}  # (device, beta1, beta2) -> [[beta1], [beta2]] for torch's own pow


class Adam(FusedOptimizer):
    """``torch.optim.Adam``/``AdamW``: both moments (and amsgrad's maximum), a device step count per parameter."""

    name = "adam"
    keys = ("exp_avg", "exp_avg_sq")
    master_weights = True
    loops = True
    classes = (torch.optim.Adam, torch.optim.AdamW)  # exactly these: a subclass may change the update

    def matches(self, inner) -> bool:
        return type(inner) in self.classes

    def state_keys(self, group):
        return self.keys + ("max_exp_avg_sq",) if group.get("amsgrad") else self.keys

    def torch_fused(self, inner, group, param, kinds, master, offload) -> bool:
        """Whether the kernel steps this parameter with torch's fused CUDA Adam/AdamW arithmetic
        (``kernels/adam.py: torch_fused_moments``), bit-identical to the unwrapped optimizer: its group
        has ``fused=True``, the parameter and every state are fp32 and resident, and the decay is
        decoupled (or zero; Adam's L2 decay is not reproduced bit for bit, so it stays with torch)."""
        if not group.get("fused") or master or offload or param.dtype != torch.float32:
            return False
        if getattr(inner, "grad_scale", None) is not None or getattr(inner, "found_inf", None) is not None:
            return False  # torch's own step unscales and skips with them
        return all(k == StateKind.FP32 for k in kinds) and (decoupled_decay(inner, group) or not group["weight_decay"])

    def prepare(self, w) -> None:
        """The step count as an fp32 tensor on the parameter's device (the kernels advance it)."""
        step = w.state.get("step")
        if not isinstance(step, torch.Tensor) or step.device != w.param.device or step.dtype != torch.float32:
            w.state["step"] = (step if isinstance(step, torch.Tensor) else torch.tensor(float(step or 0))).to(
                w.param.device, torch.float32)

    def shape_kind(self, plan) -> str:
        """4-bit states without master weights take their own (looped, register-capped) shape."""
        return "int4" if StateKind.INT4 in plan.kinds and not plan.master else super().shape_kind(plan)

    def kernel(self):
        from ..kernels.adam import adam_kernel
        return adam_kernel

    def arguments(self, launcher, bucket, launch):
        plan, group, inner = bucket.plan, launch.group, launcher.ctx.inner
        m_codec, v_codec = plan.codecs[0], plan.codecs[1]
        V, VS = launch.state(1)
        amsgrad = len(plan.keys) == 3
        VM, VMS = launch.state(2) if amsgrad else (V, VS)
        beta1, beta2 = (float(b) for b in group["betas"])
        decoupled = decoupled_decay(inner, group)
        torch_fused = bool(plan.torch_fused)
        CORR = self.bias_corrections(launcher, bucket, launch, beta1, beta2, torch_fused)
        args = (*launch.heads, V, VS, VM, VMS, CORR, *launch.tail, launch.lr_ptr, launch.lr_val, beta1, beta2,
                1.0 - beta1, 1.0 - beta2,  # in float64 on the host
                float(group["eps"]), float(group["weight_decay"]),
                *launch.codec_tables(m_codec), *launch.codec_tables(v_codec))
        kwargs = dict(**launch.codec_constexprs("M", m_codec, plan.kinds[0]),
                      **launch.codec_constexprs("V", v_codec, plan.kinds[1]),
                      P_SR=launcher.stochastic_param_rounding and launch.common["P_KIND"] == 1,
                      AMSGRAD=amsgrad, DECOUPLED=bool(decoupled), FAST_MATH=launcher.fast_math, ITERS=launch.iters,
                      TORCH_FUSED=torch_fused, maxnreg=launch.maxnreg, **self._master(bucket, launch), **launch.common)
        return args, kwargs

    @staticmethod
    def _master(bucket, launch) -> dict:
        """Kernel arguments of the master-weight path (the correction's pointer table, its bits);
        none when the bucket keeps no master weights."""
        bits = bucket.plan.master
        if not bits:
            return {}
        return {"C": launch.state(len(bucket.plan.keys))[0], "MASTER": bits}

    @staticmethod
    def bias_corrections(launcher, bucket, launch, beta1: float, beta2: float, torch_fused: bool) -> torch.Tensor:
        """The Adam kernel's CORR table for the coming step (and the step counts advanced, with
        ``launch.advance``), from the per-parameter step counts on the device: per tensor the step size
        and square-rooted second correction (``bias_corrections_kernel``), or for torch's fused
        arithmetic ``[beta1**step, beta2**step]`` by torch's own device ``pow``, whose float32
        results differ from Triton's libdevice ``powf`` in the last bit for some steps."""
        from ..kernels.adam import bias_corrections_kernel

        device, n = launch.device, len(bucket.params)
        lr_tensor = launch.common["LR_TENSOR"]
        out = torch.empty(n if torch_fused else 3 * n, dtype=torch.float32, device=device)
        launcher._run(bias_corrections_kernel, n, device,
                      (bucket.steps_table(device, launch.memo), out, launch.lr_ptr, launch.lr_val,
                       math.log(beta1) if beta1 > 0 else -1e30, math.log(beta2) if beta2 > 0 else -1e30),
                      dict(LR_TENSOR=lr_tensor, ADVANCE=launch.advance, STEP_ONLY=torch_fused))
        if not torch_fused:
            return out
        key = (str(device), beta1, beta2)
        betas = _BETAS.get(key)
        if betas is None:
            betas = _BETAS[key] = torch.tensor([[beta1], [beta2]], dtype=torch.float32, device=device)
        return torch.pow(betas, out)  # [2, n]

    def advance_steps(self, launcher, bucket) -> None:
        from ..kernels.adam import advance_steps_kernel

        device = bucket.params[0].device
        launcher._run(advance_steps_kernel, len(bucket.params), device,
                      (bucket.steps_table(device, bucket.memo(device)),), {})


ENTRY = Adam()
