"""The fused path: hand parameters to the Triton kernels when they can take them.

A parameter goes to the kernels when it is on CUDA (or on the CPU under ``TRITON_INTERPRET=1``
with ``fused=True``), the inner optimizer is ``torch.optim.Adam``/``AdamW`` or ``SGD`` with
momentum, its codecs are fp32/bf16/int8/4-bit on the device, and its stored state already has
those codecs (a codec switch, e.g. at the end of warmup, goes through the reference path once).
Everything else falls back to the reference path; the first time a reason applies it is
logged once. One launch covers every parameter of a bucket (same group, codecs, dtype, first
step or not); NaN/inf gradients are flagged on the device and their parameters skipped inside
the kernel, so a fused step never synchronises with the host.
"""
from __future__ import annotations

import logging
import math
import os
from typing import Dict, List, Optional, Tuple

import torch

from .codecs import BF16Codec, EncodedTensor, FP32Codec, Int4Codec, Int8Codec
from .codecs.rounding import state_seed, stream_key
from .kernels import interpreting, triton_error
from .store import allocate

log = logging.getLogger("optstate")

FP32, BF16, INT8, INT4 = 0, 1, 2, 3
P_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
ADAM_KEYS = ("exp_avg", "exp_avg_sq")
NBLK = int(os.environ.get("OPTSTATE_NBLK", 4))  # 256-element tiles per program
NUM_WARPS = int(os.environ.get("OPTSTATE_NUM_WARPS", 4))


def state_kind(codec) -> Optional[int]:
    """The kernel's state kind for a codec (None: the kernels cannot handle it)."""
    if isinstance(codec, FP32Codec):
        return FP32
    if isinstance(codec, BF16Codec):
        return BF16
    if isinstance(codec, Int8Codec) and codec.block_size == 256 and codec.exp_bits is None:
        return INT8
    if isinstance(codec, Int4Codec) and codec.block_size == 128:
        return INT4
    return None


class FusedPath:
    def __init__(self, engine, mode: Optional[bool], stochastic_param_rounding: bool):
        self.engine = engine
        self.mode = mode
        self.stochastic_param_rounding = stochastic_param_rounding
        self._logged = set()
        self.nonfinite_device: Optional[torch.Tensor] = None

    def _fallback(self, reason: str) -> None:
        if reason not in self._logged:
            self._logged.add(reason)
            log.info("optstate: reference path (not the fused kernel) because %s", reason)
        return None

    # -- eligibility -------------------------------------------------------------------------------
    def plan(self, w) -> Optional[dict]:
        """How the kernel would step this parameter, or None (reference path)."""
        if self.mode is False:
            return None
        p, inner = w.param, self.engine.inner
        if p.device.type != "cuda" and not (self.mode and p.device.type == "cpu" and interpreting()):
            return self._fallback(f"parameters on {p.device.type} (the fused kernels need CUDA)")
        if triton_error():
            return self._fallback(triton_error())
        if type(inner) in (torch.optim.Adam, torch.optim.AdamW):
            kind, keys = "adam", ADAM_KEYS
        elif type(inner) is torch.optim.SGD:
            kind, keys = "sgd", ("momentum_buffer",)
        else:
            return self._fallback(f"{type(inner).__name__} has no fused kernel (Adam, AdamW and SGD do)")
        group = inner.param_groups[w.info.group_index]
        if group.get("differentiable"):
            return self._fallback("differentiable=True")
        if kind == "sgd" and not group["momentum"]:
            return self._fallback("SGD without momentum has no state to compress")
        if kind == "adam" and group.get("amsgrad"):
            keys = keys + ("max_exp_avg_sq",)
        lr = group["lr"]
        if isinstance(lr, torch.Tensor) and (lr.device != p.device or lr.numel() != 1 or lr.dtype != torch.float32):
            return self._fallback("a tensor lr that is not a float32 scalar on the parameter's device")
        if p.dtype not in P_KINDS or p.is_complex():
            return self._fallback(f"parameter dtype {p.dtype}")
        if not p.is_contiguous() or not w.grad.is_contiguous() or w.grad.dtype != p.dtype:
            return self._fallback("a non-contiguous parameter or gradient, or a gradient of another dtype")
        if p.numel() == 0:
            return None
        step = self.engine.step_count
        codecs = [self.engine.policy.codec_for(w.info, k, step) for k in keys]
        kinds = [state_kind(c) for c in codecs]
        if any(k is None for k in kinds):
            return self._fallback(f"codec {codecs[kinds.index(None)]!r} has no kernel")
        if any(self.engine.policy.tier_for(w.info, k, step) != "device" for k in keys):
            return None  # offloaded state: the tiled path streams it
        present = [k for k in keys if w.state.get(k) is not None]
        first = not present
        if not first:
            if len(present) != len(keys):
                return None
            for key, codec, kd in zip(keys, codecs, kinds):
                value = w.state[key]
                if kd == FP32:
                    if not (isinstance(value, torch.Tensor) and value.dtype == torch.float32
                            and value.device == p.device and value.is_contiguous()):
                        return None
                elif not (isinstance(value, EncodedTensor) and value.codec == codec and not value.host_tier
                          and value.device == p.device):
                    return None
        if kind == "sgd" and kinds[0] == FP32 or kind == "adam" and all(k == FP32 for k in kinds):
            return None  # uncompressed: torch's own implementation (passthrough) is exact
        return {"kind": kind, "keys": keys, "codecs": codecs, "kinds": kinds, "first": first}

    # -- launch ------------------------------------------------------------------------------------------
    def run(self, planned: List[Tuple[object, dict]]) -> None:
        buckets: Dict[tuple, list] = {}
        for w, plan in planned:
            key = (w.info.group_index, plan["kind"], plan["first"], w.param.dtype, w.param.device,
                   tuple(tuple(sorted(c.config().items())) for c in plan["codecs"]))
            buckets.setdefault(key, []).append((w, plan))
        for items in buckets.values():
            self._launch(items)

    def _storage(self, w, plan):
        """The state tensors the kernel reads and writes (allocated on the first step)."""
        out = []
        for key, codec in zip(plan["keys"], plan["codecs"]):
            value = w.state.get(key)
            if value is None:
                value = allocate(codec, w.param.shape, torch.float32 if codec.lossless else w.param.dtype,
                                 w.param.device, host=False, pin_memory=False)
                if isinstance(value, torch.Tensor):
                    value = value.float()
                w.state[key] = value
            out.append(value)
        if plan["kind"] == "adam":
            step = w.state.get("step")
            if not isinstance(step, torch.Tensor) or step.device != w.param.device or step.dtype != torch.float32:
                w.state["step"] = (step if isinstance(step, torch.Tensor) else torch.tensor(float(step or 0))).to(
                    w.param.device, torch.float32)
        return out

    def _launch(self, items) -> None:
        from .kernels import launch
        from .kernels.adam import adam_kernel, advance_steps_kernel
        from .kernels.nonfinite import nonfinite_flags_kernel
        from .kernels.sgd import sgd_kernel

        engine = self.engine
        ws = [w for w, _ in items]
        plan = items[0][1]
        device = ws[0].param.device
        storages = [self._storage(w, pl) for w, pl in items]
        n = len(ws)
        group = engine.inner.param_groups[ws[0].info.group_index]

        def data_scales(i):
            vals = [s[i] for s in storages]
            if isinstance(vals[0], EncodedTensor):
                names = list(vals[0].payload)
                data = [v.payload[names[0]] for v in vals]
                scales = [v.payload.get("scales") for v in vals]
            else:
                data, scales = vals, [None] * n
            return launch.pointer_table(data, device), launch.pointer_table(scales, device)

        cols, nbr, nblocks, prog_t, prog_b, n_prog = launch.work_tables([tuple(w.param.shape) for w in ws], NBLK,
                                                                        device)
        P = launch.pointer_table([w.param for w in ws], device)
        G = launch.pointer_table([w.grad for w in ws], device)
        step = engine.step_count
        sr = any(c.stochastic_rounding for c in plan["codecs"]) or self.stochastic_param_rounding
        if sr:  # per-step stream keys of the counter hash: m, v, vmax, param
            names = (list(plan["keys"]) + [plan["keys"][-1]] * 3)[:3] + ["param"]
            KEYS = launch.device_table([stream_key(state_seed(engine.seed, w.info.index, name), step)
                                        for w in ws for name in names], device)
        else:
            KEYS = launch.cached_table([0] * (4 * n), device)
        check = engine.skip_nonfinite
        flags = torch.zeros(n if check else 1, dtype=torch.int32, device=device)
        p_kind = P_KINDS[ws[0].param.dtype]
        if check:
            nonfinite_flags_kernel[(n_prog,)](G, flags, cols, nbr, nblocks, prog_t, prog_b, P_KIND=p_kind, NBLK=NBLK)
        lr = group["lr"]
        lr_tensor = isinstance(lr, torch.Tensor)
        lr_ptr = lr if lr_tensor else flags
        lr_val = 0.0 if lr_tensor else float(lr)
        m_codec = plan["codecs"][0]
        m_tables = self._tables(m_codec, device)
        M, MS = data_scales(0)
        if plan["kind"] == "adam":
            v_codec = plan["codecs"][1]
            v_tables = self._tables(v_codec, device)
            V, VS = data_scales(1)
            amsgrad = len(plan["keys"]) == 3
            VM, VMS = data_scales(2) if amsgrad else (V, VS)
            STEPS = launch.pointer_table([w.state["step"] for w in ws], device)
            beta1, beta2 = (float(b) for b in group["betas"])
            decoupled = group.get("decoupled_weight_decay", isinstance(engine.inner, torch.optim.AdamW))
            adam_kernel[(n_prog,)](
                P, G, M, MS, V, VS, VM, VMS, STEPS, flags, KEYS, cols, nbr, nblocks, prog_t, prog_b,
                lr_ptr, lr_val, beta1, beta2, math.log2(beta1) if beta1 > 0 else -1e30,
                math.log2(beta2) if beta2 > 0 else -1e30, float(group["eps"]), float(group["weight_decay"]),
                *m_tables, *v_tables,
                P_KIND=p_kind, M_KIND=plan["kinds"][0], V_KIND=plan["kinds"][1],
                M_SR=bool(m_codec.stochastic_rounding), V_SR=bool(v_codec.stochastic_rounding),
                P_SR=self.stochastic_param_rounding and p_kind == 1,
                M_LEVELS=self._n_levels(m_codec), V_LEVELS=self._n_levels(v_codec),
                AMSGRAD=amsgrad, DECOUPLED=bool(decoupled), MAXIMIZE=bool(group.get("maximize")),
                FIRST=plan["first"], CHECK_FINITE=check, LR_TENSOR=lr_tensor, NBLK=NBLK, num_warps=NUM_WARPS)
            advance_steps_kernel[(n,)](STEPS, flags, CHECK_FINITE=check)
        else:
            sgd_kernel[(n_prog,)](
                P, G, M, MS, flags, KEYS, cols, nbr, nblocks, prog_t, prog_b,
                lr_ptr, lr_val, float(group["momentum"]), float(group["dampening"]), float(group["weight_decay"]),
                *m_tables, P_KIND=p_kind, M_KIND=plan["kinds"][0], M_SR=bool(m_codec.stochastic_rounding),
                M_LEVELS=self._n_levels(m_codec), NESTEROV=bool(group["nesterov"]),
                MAXIMIZE=bool(group.get("maximize")), FIRST=plan["first"], CHECK_FINITE=check,
                LR_TENSOR=lr_tensor, NBLK=NBLK, num_warps=NUM_WARPS)
        if check:
            total = flags.sum()
            self.nonfinite_device = total if self.nonfinite_device is None else self.nonfinite_device + total
        for w in ws:
            engine.state[w.param] = w.state
        engine.metrics.fused_params += n
        engine.metrics.kernel_launches += 3 if plan["kind"] == "adam" else 2

    @staticmethod
    def _n_levels(codec) -> int:
        return len(codec.levels) if isinstance(codec, Int4Codec) else 2

    @staticmethod
    def _tables(codec, device):
        if isinstance(codec, Int4Codec):
            levels, mids, lut = codec.tables(device)
            return levels, mids, lut
        dummy = _dummy(device)
        return dummy, dummy, dummy


_DUMMIES: Dict[str, torch.Tensor] = {}


def _dummy(device) -> torch.Tensor:
    key = str(device)
    if key not in _DUMMIES:
        _DUMMIES[key] = torch.zeros(16, dtype=torch.float32, device=device)
    return _DUMMIES[key]
