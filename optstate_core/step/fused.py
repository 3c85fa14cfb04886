"""The fused path's routing: which parameters the Triton kernels can take, grouped into launch buckets.

A parameter goes to the kernels when it is on CUDA (or on the CPU under ``TRITON_INTERPRET=1``
with ``fused=True``), the inner optimizer is ``torch.optim.Adam``/``AdamW``, ``SGD`` with
momentum or lion-pytorch's ``Lion``, its codecs are fp32/bf16/int8/4-bit on the device, and its stored state already has
those codecs (a codec switch, e.g. at the end of warmup, goes through the reference path once).
Everything else falls back to the reference path; the first time a reason applies it is
logged once. One launch covers every parameter of a bucket (same group, codecs, dtype, first
step or not); :mod:`~optstate_core.step.fused_launch` launches it and :mod:`~optstate_core.schedule.timetable`
decides when.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Dict, List, Optional, Tuple

import torch

from .bucket import Bucket, aligned_layout
from ..state.codecs import BF16Codec, EncodedTensor, Float24Codec, FP32Codec, Int4Codec, Int8Codec
from ..state.dtensor import is_dtensor, like_param, local
from .fused_launch import BF16, FP24, FP32, INT4, INT8, P_KINDS
from .kernels import interpreting, triton_error
from .inner import decoupled_decay
from .granularity import qualified_name
from .schedule_free import is_schedule_free_adamw
from .kernels.launch import MAX_TENSORS
from ..state.master_weights import MASTER_KEY
from ..state.store import allocate_many
from ..state import master_weights

log = logging.getLogger("optstate")

ADAM_KEYS = ("exp_avg", "exp_avg_sq")
SEED_ELEMENTS = 1 << 24  # rows of a new correction encoded at once (64 MiB of fp32)
MASTER_BITS = {"corr16": 16, "corr8": 8}  # correction codecs the Adam kernel's master-weight path takes


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
    if isinstance(codec, Float24Codec):
        return FP24  # schedule-free's iterate only
    return None


def first_step_states(plan: dict, param_dtype: torch.dtype) -> List[tuple]:
    """``(key, codec, dtype, on host)`` of each state a plan allocates on its first step: the
    moments (fp32 when lossless or beside master weights, else the parameter's dtype), then the
    master-weight correction (fp32)."""
    out = [(key, codec, torch.float32 if codec.lossless or plan["master"] else param_dtype, on_host)
           for key, codec, on_host in zip(plan["keys"], plan["codecs"], plan["host"])]
    if plan["master"]:
        out.append((MASTER_KEY, plan["master_codec"], torch.float32, plan["host"][-1]))
    return out


def is_lion(inner) -> bool:
    """lion-pytorch's ``Lion`` with its own (torch) update function, which the Lion kernel reproduces."""
    if qualified_name(type(inner)) != "lion_pytorch.lion_pytorch.Lion":
        return False
    update = getattr(inner, "update_fn", None)
    return getattr(update, "__module__", None) == "lion_pytorch.lion_pytorch" and update.__name__ == "update_fn"


class FusedPath:
    """Eligibility of parameters for the kernels, and their grouping into buckets."""

    def __init__(self, engine, mode: Optional[bool]):
        self.engine = engine
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
    def _kernel_device(self, p) -> bool:
        """The parameter is where the kernels run: CUDA, or the CPU under ``TRITON_INTERPRET=1``
        with ``fused=True``."""
        return p.device.type == "cuda" or bool(self.mode and p.device.type == "cpu" and interpreting())

    def plan(self, w, allow_uncompressed: bool = False) -> Optional[dict]:
        """How the kernel would step this parameter, or None (reference path). Uncompressed
        state goes to torch's own implementation unless ``allow_uncompressed``."""
        if self.mode is False:
            return None
        p, inner = w.param, self.engine.inner
        if not self._kernel_device(p):
            return self._fallback(f"parameters on {p.device.type} (the fused kernels need CUDA)")
        if triton_error():
            return self._fallback(triton_error())
        if type(inner) in (torch.optim.Adam, torch.optim.AdamW):
            kind, keys = "adam", ADAM_KEYS
        elif type(inner) is torch.optim.SGD:
            kind, keys = "sgd", ("momentum_buffer",)
        elif is_lion(inner):
            kind, keys = "lion", ("exp_avg",)
        elif is_schedule_free_adamw(inner):
            kind, keys = "schedule_free", ("z", "exp_avg_sq")
        else:
            return self._fallback(f"{type(inner).__name__} has no fused kernel (Adam, AdamW, SGD and "
                                  "lion-pytorch's Lion do)")
        group = inner.param_groups[w.info.group_index]
        if group.get("differentiable"):
            return self._fallback("differentiable=True")
        if kind == "sgd" and not group["momentum"]:
            return self._fallback("SGD without momentum has no state to compress")
        if kind == "adam" and group.get("amsgrad"):
            keys = keys + ("max_exp_avg_sq",)
        lr = group["lr"]
        if kind in ("lion", "schedule_free") and isinstance(lr, torch.Tensor):
            return self._fallback(f"{type(inner).__name__} with a tensor lr")
        if isinstance(lr, torch.Tensor) and (lr.device != p.device or lr.numel() != 1 or lr.dtype != torch.float32):
            return self._fallback("a tensor lr that is not a float32 scalar on the parameter's device")
        if p.dtype not in P_KINDS or p.is_complex():
            return self._fallback(f"parameter dtype {p.dtype}")
        if not p.is_contiguous() or not w.grad.is_contiguous() or w.grad.dtype != p.dtype:
            return self._fallback("a non-contiguous parameter or gradient, or a gradient of another dtype")
        if p.numel() == 0:
            return None
        master, master_codec = 0, self.engine.policy.master_codec(w.info)
        if master_codec is not None:
            if kind != "adam" or p.dtype != torch.bfloat16 or master_codec.name not in MASTER_BITS:
                return self._fallback("master weights other than Adam/AdamW on bf16 parameters with a corr16/corr8 "
                                      "correction")
            master_codec = self.engine.codec_of(w, MASTER_KEY)
            master = MASTER_BITS.get(master_codec.name)
            if master is None:
                return self._fallback(f"master-weight correction codec {master_codec!r} has no kernel")
        codecs = [self.engine.codec_of(w, k) for k in keys]
        kinds = [state_kind(c) for c in codecs]
        if any(k is None for k in kinds):
            return self._fallback(f"codec {codecs[kinds.index(None)]!r} has no kernel")
        if (kind == "schedule_free" and kinds[0] not in (FP32, BF16, FP24)) or \
                (FP24 in kinds and kind != "schedule_free") or (kind == "schedule_free" and FP24 in kinds[1:]):
            return self._fallback(f"codecs {codecs!r} for {keys} of {type(inner).__name__} (the iterate z takes "
                                  "fp32, bf16 or fp24, the moments no fp24)")
        # per state (moments, then the correction): in host memory (streamed through the staging
        # ring each step) or resident; a parameter may mix both (e.g. a host-tier correction)
        host = tuple(self.engine.tier_of(w, k) == "host" for k in keys + ((MASTER_KEY,) if master else ()))
        offload = any(host)
        if offload:  # a parameter streams in row pieces: one row must fit a chunk (half the ring)
            row = sum(c.nbytes(1, w.cols, torch.float32 if c.lossless else p.dtype) + 64
                      for c, on_host in zip(codecs + ([master_codec] if master else []), host) if on_host)
            if row > self.engine.placement.staging_size(p.device) // 2:
                return self._fallback("one row of a parameter's state is larger than half the staging ring "
                                      "(raise staging_bytes)")
        present = [k for k in keys if w.state.get(k) is not None]
        first = not present
        if not first:
            if len(present) != len(keys):
                return None
            for key, codec, kd, on_host in zip(keys, codecs, kinds, host):
                value = w.state[key]
                if on_host:
                    if not (isinstance(value, EncodedTensor) and value.codec == codec and value.host_tier
                            and value.device.type == "cpu" and value.payload_contiguous()):
                        return None
                elif kd == FP32:
                    value = local(value)
                    if not (isinstance(value, torch.Tensor) and value.dtype == torch.float32
                            and value.device == p.device and value.is_contiguous()):
                        return None
                elif not (isinstance(value, EncodedTensor) and value.codec == codec and not value.host_tier
                          and value.device == p.device):
                    return None
        if master and w.state.get(MASTER_KEY) is not None:
            value = w.state[MASTER_KEY]
            if not (isinstance(value, EncodedTensor) and value.codec == master_codec and value.host_tier == host[-1]
                    and value.device == (torch.device("cpu") if host[-1] else p.device) and value.payload_contiguous()):
                return None
        if not master and not allow_uncompressed and not offload and all(k == FP32 for k in kinds):
            return None  # uncompressed: torch's own implementation (passthrough) is exact
        return {"kind": kind, "keys": keys, "codecs": codecs, "kinds": kinds, "first": first, "offload": offload,
                "host": host, "master": master, "master_codec": master_codec if master else None,
                "torch_fused": self._torch_fused_math(group, p, kind, kinds, master, offload)}

    def _torch_fused_math(self, group, p, kind, kinds, master, offload) -> bool:
        """Whether the kernel steps this parameter with torch's fused CUDA Adam/AdamW arithmetic
        (``kernels/adam.py: torch_fused_moments``), bit-identical to the unwrapped optimizer: its group
        has ``fused=True``, the parameter and every state are fp32 and resident, and the decay is
        decoupled (or zero; Adam's L2 decay is not reproduced bit for bit, so it stays with torch)."""
        if kind != "adam" or not group.get("fused") or master or offload or p.dtype != torch.float32:
            return False
        inner = self.engine.inner
        if getattr(inner, "grad_scale", None) is not None or getattr(inner, "found_inf", None) is not None:
            return False  # torch's own step unscales and skips with them
        return all(k == FP32 for k in kinds) and (decoupled_decay(inner, group) or not group["weight_decay"])

    def takes_uncompressed(self, w, beside: bool) -> Optional[dict]:
        """The plan of a parameter with uncompressed state if the kernels step it, else None (torch's
        own step): ``beside`` compressed ones (the same launches, no second optimizer), or alone
        where the kernel steps it bit-identically to torch's fused Adam/AdamW (NaN/inf then skipped
        per block, with no extra pass)."""
        if self.mode is False or not self._kernel_device(w.param):
            return None
        plan = self.plan(w, allow_uncompressed=True)
        return plan if plan is not None and (beside or plan["torch_fused"]) else None

    # -- launch ------------------------------------------------------------------------------------------
    def build(self, planned: List[Tuple[object, dict]]) -> List["Bucket"]:
        """Group planned parameters into launches; allocate state on a first step."""
        groups: Dict[tuple, list] = {}
        for w, plan in planned:
            key = (w.info.group_index, plan["kind"], plan["first"], plan["host"], plan["master"], w.param.dtype,
                   w.param.device,
                   tuple(tuple(sorted(c.config().items())) for c in plan["codecs"]), aligned_layout(w.param))
            groups.setdefault(key, []).append((w, plan))
        buckets = []
        split = [items[i:i + MAX_TENSORS - 1] for items in groups.values() for i in range(0, len(items), MAX_TENSORS - 1)]
        for items in split:
            plan = items[0][1]
            ws = [w for w, _ in items]
            self._allocate_missing(ws, plan)
            storages = [self._storage(w, plan) for w in ws]
            for w in ws:
                self.engine.state[w.key] = w.state
            buckets.append(Bucket(ws, storages, plan))
        # the largest launch first: the device starts on the bulk of the step while the host queues the rest
        return sorted(buckets, key=lambda b: -sum(p.numel() for p in b.params))

    def pins(self, param) -> bool:
        """Whether this parameter's host-tier state is pinned (``pin_memory``; by default on CUDA)."""
        pin_memory = self.engine.pin_memory
        return pin_memory if pin_memory is not None else param.device.type == "cuda"

    def _allocate_missing(self, ws, plan) -> None:
        """First step: one allocation per state key for the whole bucket (pinned host memory
        for offloaded state)."""
        pin = self.pins(ws[0].param)
        for key, codec, dtype, on_host in first_step_states(plan, ws[0].param.dtype):
            missing = [w for w in ws if w.state.get(key) is None]
            if not missing:
                continue
            values = allocate_many(codec, [w.param.shape for w in missing], dtype, missing[0].param.device,
                                   host=on_host, pin_memory=on_host and pin, arena=self.engine.pinned)
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
        out = [local(w.state[key]) for key in plan["keys"]]
        if plan["master"]:
            out.append(local(w.state[MASTER_KEY]))
        if plan["kind"] == "adam":
            step = w.state.get("step")
            if not isinstance(step, torch.Tensor) or step.device != w.param.device or step.dtype != torch.float32:
                w.state["step"] = (step if isinstance(step, torch.Tensor) else torch.tensor(float(step or 0))).to(
                    w.param.device, torch.float32)
        return out
