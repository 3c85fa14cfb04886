"""The fused path's routing: which parameters the Triton kernels can take, grouped into launch buckets.

A parameter goes to the kernels when it is on CUDA (or on the CPU under ``TRITON_INTERPRET=1``
with ``fused=True``), the inner optimizer has an entry in :mod:`~optstate_core.step.fused_optimizers`
(``torch.optim.Adam``/``AdamW``, ``SGD`` with momentum, lion-pytorch's ``Lion``, schedule-free
AdamW) that takes its group, its codecs have a kernel form (fp32/bf16/int8/4-bit on the device),
and its stored state already has those codecs (a codec switch, e.g. at the end of warmup, goes
through the reference path once). Everything else falls back to the reference path; the first
time a reason applies it is logged once. One launch covers every parameter of a bucket (same
group, codecs, dtype, first step or not); :mod:`~optstate_core.step.fused_launch` launches it and
:mod:`~optstate_core.schedule.timetable` decides when.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Dict, List, Optional, Tuple

import torch

from .bucket import Bucket, aligned_layout
from .context import Residency, StepContext
from ..state.codecs import EncodedTensor, StateKind
from ..state.dtensor import is_dtensor, like_param, local
from .fused_launch import P_KINDS
from .fused_optimizers import FusedPlan, entry_for, no_kernel
from .kernels import interpreting, triton_error
from .kernels.launch import MAX_TENSORS
from ..state.master_weights import MASTER_KEY
from ..state.pinned import PinnedArena
from ..state.store import allocate_many
from ..state import master_weights

log = logging.getLogger("optstate")

SEED_ELEMENTS = 1 << 24  # rows of a new correction encoded at once (64 MiB of fp32)
MASTER_BITS = {"corr16": 16, "corr8": 8}  # correction codecs the kernels' master-weight path takes


def first_step_states(plan: FusedPlan, param_dtype: torch.dtype) -> List[tuple]:
    """``(key, codec, dtype, on host)`` of each state a plan allocates on its first step: the
    moments (fp32 when lossless or beside master weights, else the parameter's dtype), then the
    master-weight correction (fp32)."""
    out = [(key, codec, torch.float32 if codec.lossless or plan.master else param_dtype, on_host)
           for key, codec, on_host in zip(plan.keys, plan.codecs, plan.host)]
    if plan.master:
        out.append((MASTER_KEY, plan.master_codec, torch.float32, plan.host[-1]))
    return out


class FusedPath:
    """Eligibility of parameters for the kernels, and their grouping into buckets."""

    def __init__(self, ctx: StepContext, residency: Residency, pinned: PinnedArena, mode: Optional[bool]):
        self.ctx, self.residency, self.pinned = ctx, residency, pinned
        self.mode = mode
        self._logged = set()
        self._quiet = False

    @contextlib.contextmanager
    def quiet(self):
        """Plans made inside log no fallback (a prediction, not a step)."""
        saved, self._quiet = self._quiet, True
        try:
            yield
        finally:
            self._quiet = saved

    def _fallback(self, reason: str) -> None:
        if reason not in self._logged and not self._quiet:
            self._logged.add(reason)
            log.info("optstate: reference path (not the fused kernel) because %s", reason)
        return None

    # -- eligibility -------------------------------------------------------------------------------
    def kernel_device(self, p) -> bool:
        """The parameter is where the kernels run: CUDA, or the CPU under ``TRITON_INTERPRET=1``
        with ``fused=True``."""
        return p.device.type == "cuda" or bool(self.mode and p.device.type == "cpu" and interpreting())

    def plan(self, w, allow_uncompressed: bool = False) -> Optional[FusedPlan]:
        """How the kernel would step this parameter, or None (reference path). Uncompressed
        state goes to torch's own implementation unless ``allow_uncompressed``."""
        if self.mode is False:
            return None
        p, inner, step = w.param, self.ctx.inner, self.ctx.step_count
        if not self.kernel_device(p):
            return self._fallback(f"parameters on {p.device.type} (the fused kernels need CUDA)")
        if triton_error():
            return self._fallback(triton_error())
        entry = entry_for(inner)
        if entry is None:
            return self._fallback(no_kernel(inner))
        group = inner.param_groups[w.info.group_index]
        reason = self._refusal(w, entry, group)
        if reason is not None:
            return self._fallback(reason)
        if p.numel() == 0:
            return None
        master, master_codec, reason = self._master(w, entry)
        if reason is not None:
            return self._fallback(reason)
        keys = entry.state_keys(group)
        codecs = [self.residency.codec_of(w, k, step) for k in keys]
        kinds = [c.kernel_form for c in codecs]
        if any(k is None for k in kinds):
            return self._fallback(f"codec {codecs[kinds.index(None)]!r} has no kernel")
        if not entry.allows(kinds):
            return self._fallback(f"codecs {codecs!r} for {keys} of {type(inner).__name__} (the iterate z takes "
                                  "fp32, bf16 or fp24, the moments no fp24)")
        # per state (moments, then the correction): in host memory (streamed through the staging
        # ring each step) or resident; a parameter may mix both (e.g. a host-tier correction)
        host = tuple(self.residency.tier_of(w, k, step) == "host" for k in keys + ((MASTER_KEY,) if master else ()))
        offload = any(host)
        row = self._row_bytes(w, codecs + ([master_codec] if master else []), host) if offload else 0
        if offload and row > self.residency.staging_size(p.device) // 2:  # streamed rows: one fits a chunk
            return self._fallback("one row of a parameter's state is larger than half the staging ring "
                                  "(raise staging_bytes)")
        first = all(w.state.get(k) is None for k in keys)
        if not first and not self._stored_as_planned(w, keys, codecs, kinds, host):
            return None
        if master and w.state.get(MASTER_KEY) is not None:
            value = w.state[MASTER_KEY]
            if not (isinstance(value, EncodedTensor) and value.codec == master_codec and value.host_tier == host[-1]
                    and value.device == (torch.device("cpu") if host[-1] else p.device) and value.payload_contiguous()):
                return None
        if not master and not allow_uncompressed and not offload and all(k == StateKind.FP32 for k in kinds):
            return None  # uncompressed: torch's own implementation (passthrough) is exact
        return FusedPlan(entry, keys, tuple(codecs), tuple(kinds), first, offload, host, master,
                         master_codec if master else None,
                         entry.torch_fused(inner, group, p, kinds, master, offload))

    def _refusal(self, w, entry, group) -> Optional[str]:
        """Why the kernel cannot take this parameter of ``group`` whatever its state, or None."""
        p, inner = w.param, self.ctx.inner
        if group.get("differentiable"):
            return "differentiable=True"
        reason = entry.refusal(inner, group)
        if reason is not None:
            return reason
        lr = group["lr"]
        if isinstance(lr, torch.Tensor) and (lr.device != p.device or lr.numel() != 1 or lr.dtype != torch.float32):
            return "a tensor lr that is not a float32 scalar on the parameter's device"
        if p.dtype not in P_KINDS or p.is_complex():
            return f"parameter dtype {p.dtype}"
        if not p.is_contiguous() or not w.grad.is_contiguous() or w.grad.dtype != p.dtype:
            return "a non-contiguous parameter or gradient, or a gradient of another dtype"
        return None

    def _master(self, w, entry) -> tuple:
        """``(bits, correction codec, None)`` of the parameter's master weights (``(0, None, None)``:
        none), or ``(0, None, reason)`` when the kernel cannot keep them."""
        master_codec = self.ctx.policy.master_codec(w.info)
        if master_codec is None:
            return 0, None, None
        if not entry.master_weights or w.param.dtype != torch.bfloat16 or master_codec.name not in MASTER_BITS:
            return 0, None, "master weights other than Adam/AdamW on bf16 parameters with a corr16/corr8 correction"
        master_codec = self.residency.codec_of(w, MASTER_KEY, self.ctx.step_count)
        master = MASTER_BITS.get(master_codec.name)
        if master is None:
            return 0, None, f"master-weight correction codec {master_codec!r} has no kernel"
        return master, master_codec, None

    @staticmethod
    def _row_bytes(w, codecs, host) -> int:
        """Bytes of one row of the parameter's host-tier states, as they stream."""
        return sum(c.nbytes(1, w.cols, torch.float32 if c.lossless else w.param.dtype) + 64
                   for c, on_host in zip(codecs, host) if on_host)

    @staticmethod
    def _stored_as_planned(w, keys, codecs, kinds, host) -> bool:
        """Every state is stored in the form the kernel reads: its codec, tier and device."""
        p = w.param
        if any(w.state.get(k) is None for k in keys):
            return False
        for key, codec, kd, on_host in zip(keys, codecs, kinds, host):
            value = w.state[key]
            if on_host:
                if not (isinstance(value, EncodedTensor) and value.codec == codec and value.host_tier
                        and value.device.type == "cpu" and value.payload_contiguous()):
                    return False
            elif kd == StateKind.FP32:
                value = local(value)
                if not (isinstance(value, torch.Tensor) and value.dtype == torch.float32
                        and value.device == p.device and value.is_contiguous()):
                    return False
            elif not (isinstance(value, EncodedTensor) and value.codec == codec and not value.host_tier
                      and value.device == p.device):
                return False
        return True

    def takes_uncompressed(self, w, beside: bool) -> Optional[dict]:
        """The plan of a parameter with uncompressed state if the kernels step it, else None (torch's
        own step): ``beside`` compressed ones (the same launches, no second optimizer), or alone
        where the kernel steps it bit-identically to torch's fused Adam/AdamW (NaN/inf then skipped
        per block, with no extra pass)."""
        if self.mode is False or not self.kernel_device(w.param):
            return None
        plan = self.plan(w, allow_uncompressed=True)
        return plan if plan is not None and (beside or plan.torch_fused) else None

    # -- launch ------------------------------------------------------------------------------------------
    def build(self, planned: List[Tuple[object, FusedPlan]]) -> List["Bucket"]:
        """Group planned parameters into launches; allocate state on a first step."""
        groups: Dict[tuple, list] = {}
        for w, plan in planned:
            key = (w.info.group_index, plan.kind, plan.first, plan.host, plan.master, w.param.dtype, w.param.device,
                   tuple(tuple(sorted(c.config().items())) for c in plan.codecs), aligned_layout(w.param))
            groups.setdefault(key, []).append((w, plan))
        buckets = []
        split = [items[i:i + MAX_TENSORS - 1] for items in groups.values() for i in range(0, len(items), MAX_TENSORS - 1)]
        for items in split:
            plan = items[0][1]
            ws = [w for w, _ in items]
            self._allocate_missing(ws, plan)
            storages = [self._storage(w, plan) for w in ws]
            for w in ws:
                self.ctx.store[w.key] = w.state
            buckets.append(Bucket(ws, storages, plan))
        # the largest launch first: the device starts on the bulk of the step while the host queues the rest
        return sorted(buckets, key=lambda b: -sum(p.numel() for p in b.params))

    def _allocate_missing(self, ws, plan) -> None:
        """First step: one allocation per state key for the whole bucket (pinned host memory
        for offloaded state)."""
        pin = self.ctx.pins(ws[0].param.device)
        for key, codec, dtype, on_host in first_step_states(plan, ws[0].param.dtype):
            missing = [w for w in ws if w.state.get(key) is None]
            if not missing:
                continue
            values = allocate_many(codec, [w.param.shape for w in missing], dtype, missing[0].param.device,
                                   host=on_host, pin_memory=on_host and pin, arena=self.pinned)
            for w, value in zip(missing, values):
                if key == MASTER_KEY:  # the correction starts from what cast_model dropped, else zero
                    self._seed_correction(w, value, codec)
                elif isinstance(value, torch.Tensor) and is_dtensor(w.key):
                    value = like_param(w.key, value)
                w.state[key] = value

    def _seed_correction(self, w, value, codec) -> None:
        """Encode a new correction from what ``cast_model`` dropped (else zero) on the parameter's
        device, in blocks of rows of at most :data:`SEED_ELEMENTS` elements (an 8B model's
        embedding would otherwise take 2 GiB of fp32 at once), copied down when it lives on the host."""
        where = w.param.device
        rows, cols = value.slab
        seed = master_weights.seed_of(w.key)
        seed = None if seed is None else seed.reshape(value.slab)
        step = max(1, SEED_ELEMENTS // max(cols, 1))
        for r0 in range(0, rows, step):
            r1 = min(rows, r0 + step)
            part = torch.zeros(r1 - r0, cols, device=where) if seed is None else seed[r0:r1].to(where)
            target = {name: t[r0:r1] for name, t in value.payload.items()}  # the correction's one row per slab row
            staged = target if value.device == where else codec.empty(r1 - r0, cols, where)
            codec.encode_into(part, staged, None)
            if staged is not target:
                for name, t in staged.items():
                    target[name].copy_(t)
        master_weights.forget_seed(w.key)

    def _storage(self, w, plan):
        """The state tensors the kernel reads and writes (local shards); the master-weight
        correction last."""
        out = [local(w.state[key]) for key in plan.keys]
        if plan.master:
            out.append(local(w.state[MASTER_KEY]))
        plan.optimizer.prepare(w)  # what the kernel reads beside the states (Adam's step tensor)
        return out
