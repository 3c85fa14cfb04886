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
from .codecs.rounding import state_seed, step_mix
from .kernels import interpreting, triton_error
from .dtensor import agree_on_flags, any_distributed, is_dtensor, like_param, local
from .store import allocate_many
from .transfer import StagingRing, Streams

log = logging.getLogger("optstate")

FP32, BF16, INT8, INT4 = 0, 1, 2, 3
P_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
ADAM_KEYS = ("exp_avg", "exp_avg_sq")
# launch shape (256-element tiles per program, warps), tuned on an H200: int8/bf16 states
# (4, 4); 4-bit states, whose codebook reads are latency-bound, (2, 2). Env vars override.
NBLK = int(os.environ.get("OPTSTATE_NBLK", 4))
NUM_WARPS = int(os.environ.get("OPTSTATE_NUM_WARPS", 4))
NBLK_4BIT, NUM_WARPS_4BIT = (int(os.environ.get("OPTSTATE_NBLK", 2)), int(os.environ.get("OPTSTATE_NUM_WARPS", 2)))
# hardware sqrt/division approximations (a few ulp) in the update; "0" for correctly rounded ones
FAST_MATH = os.environ.get("OPTSTATE_FAST_MATH", "1") == "1"


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
        self._streams: Optional[Streams] = None
        self._ring: Optional[StagingRing] = None
        self.last_writeback = None  # event of the last queued write-back
        self.step_writeback = None  # the previous step's last write-back: this step's uploads wait on it
        self.prefetched: Dict[int, tuple] = {}  # id(param) -> (ring offset, staged state, upload event)
        self.prefetched_bytes = 0
        self._where: Dict[int, tuple] = {}

    def _fallback(self, reason: str) -> None:
        if reason not in self._logged:
            self._logged.add(reason)
            log.info("optstate: reference path (not the fused kernel) because %s", reason)
        return None

    # -- eligibility -------------------------------------------------------------------------------
    def plan(self, w, allow_uncompressed: bool = False) -> Optional[dict]:
        """How the kernel would step this parameter, or None (reference path). Uncompressed
        state goes to torch's own implementation unless ``allow_uncompressed``."""
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
        codecs = [self.engine.codec_of(w, k) for k in keys]
        kinds = [state_kind(c) for c in codecs]
        if any(k is None for k in kinds):
            return self._fallback(f"codec {codecs[kinds.index(None)]!r} has no kernel")
        tiers = {self.engine.tier_of(w, k) for k in keys}
        if len(tiers) != 1:
            return self._fallback("a parameter with states in different tiers")
        offload = tiers == {"host"}
        if offload:  # a parameter streams in row pieces: one row must fit a chunk (half the ring)
            row = sum(c.nbytes(1, w.cols, torch.float32 if c.lossless else p.dtype) + 64 for c in codecs)
            if row > self.engine.staging_size(p.device) // 2:
                return self._fallback("one row of a parameter's state is larger than half the staging ring "
                                      "(raise staging_bytes)")
        present = [k for k in keys if w.state.get(k) is not None]
        first = not present
        if not first:
            if len(present) != len(keys):
                return None
            for key, codec, kd in zip(keys, codecs, kinds):
                value = w.state[key]
                if offload:
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
        if not allow_uncompressed and not offload and all(k == FP32 for k in kinds):
            return None  # uncompressed: torch's own implementation (passthrough) is exact
        return {"kind": kind, "keys": keys, "codecs": codecs, "kinds": kinds, "first": first, "offload": offload}

    # -- launch ------------------------------------------------------------------------------------------
    def build(self, planned: List[Tuple[object, dict]]) -> List["Bucket"]:
        """Group planned parameters into launches; allocate state on a first step."""
        groups: Dict[tuple, list] = {}
        for w, plan in planned:
            key = (w.info.group_index, plan["kind"], plan["first"], plan["offload"], w.param.dtype, w.param.device,
                   tuple(tuple(sorted(c.config().items())) for c in plan["codecs"]), _aligned(w.param))
            groups.setdefault(key, []).append((w, plan))
        buckets = []
        from .kernels.launch import MAX_TENSORS
        split = [items[i:i + MAX_TENSORS - 1] for items in groups.values() for i in range(0, len(items), MAX_TENSORS - 1)]
        for items in split:
            plan = items[0][1]
            ws = [w for w, _ in items]
            self._allocate_missing(ws, plan)
            storages = [self._storage(w, plan) for w in ws]
            for w in ws:
                self.engine.state[w.key] = w.state
            buckets.append(Bucket(ws, storages, plan))
        return buckets

    def _allocate_missing(self, ws, plan) -> None:
        """First step: one allocation per state key for the whole bucket (pinned host memory
        for offloaded state)."""
        offload = plan["offload"]
        pin = self.engine.pin_memory if self.engine.pin_memory is not None else ws[0].param.device.type == "cuda"
        for key, codec in zip(plan["keys"], plan["codecs"]):
            missing = [w for w in ws if w.state.get(key) is None]
            if missing:
                dtype = torch.float32 if codec.lossless else missing[0].param.dtype
                values = allocate_many(codec, [w.param.shape for w in missing], dtype, missing[0].param.device,
                                       host=offload, pin_memory=offload and pin)
                for w, value in zip(missing, values):
                    w.state[key] = like_param(w.key, value) if isinstance(value, torch.Tensor) and is_dtensor(w.key) \
                        else value

    def _storage(self, w, plan):
        """The state tensors the kernel reads and writes (local shards)."""
        out = [local(w.state[key]) for key in plan["keys"]]
        if plan["kind"] == "adam":
            step = w.state.get("step")
            if not isinstance(step, torch.Tensor) or step.device != w.param.device or step.dtype != torch.float32:
                w.state["step"] = (step if isinstance(step, torch.Tensor) else torch.tensor(float(step or 0))).to(
                    w.param.device, torch.float32)
        return out

    def __getstate__(self):
        self.sync()
        state = dict(self.__dict__)
        state.update(_streams=None, _ring=None, last_writeback=None, step_writeback=None, prefetched={},
                     prefetched_bytes=0, _where={})
        return state

    # -- streamed (offloaded) buckets ---------------------------------------------------------------
    def streams(self, device) -> Streams:
        if self._streams is None or self._streams.device != device:
            self._streams = Streams(device)
        return self._streams

    def ring(self, device) -> StagingRing:
        if self._ring is None:
            self._ring = StagingRing(self.engine.staging_size(device), device, self.streams(device))
        return self._ring

    def sync(self) -> None:
        """Wait for queued write-backs (before the host payloads are read, replaced or freed)."""
        if self.last_writeback is not None:
            self.last_writeback.synchronize()
            self.last_writeback = self.step_writeback = None

    def close(self) -> None:
        from .kernels import launch
        self.sync()
        self._ring = None
        self._streams = None
        self.prefetched.clear()
        launch.clear_caches()

    def _stage(self, bucket, pieces, start):
        """Device views (in the ring, from ``start``) for the state rows of ``pieces``, laid out
        per (state, payload) in piece order with 16-byte padding, like the host arena, so that
        adjacent host rows map to adjacent ring bytes and copy as one range."""
        staged = [[dict() for _ in bucket.storages[i]] for i, _, _ in pieces]
        off = start
        for k, enc0 in enumerate(bucket.storages[pieces[0][0]]):
            for name in enc0.payload:
                for (i, r0, r1), views in zip(pieces, staged):
                    rows = bucket.storages[i][k].payload[name][r0:r1]
                    n = rows.numel() * rows.element_size()
                    views[k][name] = self._ring.view(off, n, rows.dtype, rows.shape)
                    off += -(-n // 16) * 16
        return [[EncodedTensor(enc.codec, views[k], (r1 - r0, bucket.cols[i]), enc.dtype)
                 for k, enc in enumerate(bucket.storages[i])] for (i, r0, r1), views in zip(pieces, staged)]

    def _transfer(self, bucket, pieces, staged, upload: bool, streams) -> int:
        """Copy the state rows of ``pieces`` between host memory and their staged views, one copy
        per run of adjacent rows (the host arena and the ring share one layout)."""
        pairs = []  # (host tensor, ring tensor) per piece, state and payload, in ring order
        for k, enc0 in enumerate(bucket.storages[pieces[0][0]]):
            for name in enc0.payload:
                for (i, r0, r1), values in zip(pieces, staged):
                    pairs.append((bucket.storages[i][k].payload[name][r0:r1], values[k].payload[name]))
        moved = 0
        with streams.on(streams.h2d if upload else streams.d2h):
            for host, ring in _coalesce(pairs):
                (ring.copy_(host, non_blocking=True) if upload else host.copy_(ring, non_blocking=True))
                moved += host.numel()
        return moved

    def prefetch(self, param) -> None:
        """Backward hook: start uploading this parameter's offloaded state (within half the ring)."""
        located = self._where.get(id(param))
        if located is None or id(param) in self.prefetched or not self.engine.boundary.will_step:
            return
        bucket, i = located
        piece = (i, 0, bucket.rows[i])
        nbytes = bucket.piece_bytes(piece)
        device = param.device
        ring, streams = self.ring(device), self.streams(device)
        if self.prefetched_bytes + nbytes > ring.size // 2:
            return
        start = ring.reserve(nbytes, streams.h2d)
        staged = self._stage(bucket, [piece], start)
        streams.wait(streams.h2d, self.last_writeback)  # during backward: the last step's write-backs
        self.engine.transfers.h2d_bytes += self._transfer(bucket, [piece], staged, True, streams)
        self.prefetched[id(param)] = (start, staged[0], streams.event(streams.h2d))
        self.prefetched_bytes += nbytes

    def index_offloaded(self, buckets) -> None:
        """Where each streamed parameter sits in the cached plan (for the prefetch hooks)."""
        self._where = {id(k): (b, i) for b in buckets if b.plan["offload"] for i, k in enumerate(b.keys)}

    def launch_all(self, buckets) -> None:
        """Launch a step's buckets: resident ones directly; streamed ones through the ring, with
        everything prefetched during backward consumed (and its ring space released) first."""
        streamed = [b for b in buckets if b.plan["offload"]]
        for b in buckets:
            if not b.plan["offload"]:
                self._launch_kernels(b)
        if not streamed:
            return
        ring = self.ring(streamed[0].params[0].device)
        # Uploads of this step must not read host rows the previous step is still writing back;
        # within a step chunks are disjoint, so uploads and write-backs overlap (PCIe duplex).
        self.step_writeback = self.last_writeback
        work = []
        for b in streamed:
            flags = self._nonfinite_flags(b)
            pre = [(i, 0, b.rows[i]) for i, k in enumerate(b.keys) if id(k) in self.prefetched]
            work.append((b, flags, pre))
        for b, flags, pre in work:
            if pre:
                self._stream_chunk(b, flags, pre, prefetched=True)
        for b, flags, pre in work:
            done = {i for i, _, _ in pre}
            rest = [i for i in range(len(b.params)) if i not in done]
            for chunk in b.chunks(rest, ring.size // 2):
                self._stream_chunk(b, flags, chunk, prefetched=False)
            self._advance_steps(b, flags)
            b.first = False
            self.engine.metrics.fused_params += len(b.params)
        self.prefetched_bytes = 0
        ring.head = 0  # the same offsets every step: pointer tables stay cached

    def _stream_chunk(self, bucket, flags, pieces, prefetched: bool) -> None:
        device = bucket.params[0].device
        ring, streams, transfers = self.ring(device), self.streams(device), self.engine.transfers
        if prefetched:
            regions, staged = [], []
            for i, _, _ in pieces:
                start, values, ev_up = self.prefetched.pop(id(bucket.keys[i]))
                streams.wait(None, ev_up)
                regions.append(start)
                staged.append(values)
        else:
            start = ring.reserve(sum(bucket.piece_bytes(pc) for pc in pieces), streams.h2d)
            regions, staged = [start], self._stage(bucket, pieces, start)
            if not bucket.first:
                streams.wait(streams.h2d, self.step_writeback)
                transfers.h2d_bytes += self._transfer(bucket, pieces, staged, True, streams)
            streams.wait(None, streams.event(streams.h2d))
        self._launch_kernels(bucket.sub(pieces, staged), flags=flags, advance=False)
        streams.wait(streams.d2h, streams.event(None))
        transfers.d2h_bytes += self._transfer(bucket, pieces, staged, False, streams)
        done = streams.event(streams.d2h)
        for start in regions:
            ring.release(start, done)
        self.last_writeback = done

    def _nonfinite_flags(self, bucket):
        """Per-parameter NaN/inf flags of a whole bucket (device tensor), or None if unchecked."""
        from .kernels import launch
        from .kernels.nonfinite import nonfinite_flags_kernel

        if not self.engine.skip_nonfinite:
            return None
        device, n = bucket.params[0].device, len(bucket.params)
        cols, nbr, nblocks, prog_start, n_t, tpow2, n_prog = launch.work_tables(bucket.shapes, NBLK, device)
        flags = torch.zeros(n, dtype=torch.int32, device=device)
        G = launch.pointer_table(bucket.grad_list(), device)
        nonfinite_flags_kernel[(n_prog,)](G, flags, cols, nbr, nblocks, prog_start, n_t, tpow2,
                                          P_KIND=P_KINDS[bucket.params[0].dtype], NBLK=NBLK, ALIGNED=bucket.aligned,
                                          num_warps=NUM_WARPS)
        if any_distributed(bucket.keys):
            agree_on_flags(flags)
        total = flags.sum()
        self.nonfinite_device = total if self.nonfinite_device is None else self.nonfinite_device + total
        return flags

    def _advance_steps(self, bucket, flags) -> None:
        from .kernels.adam import advance_steps_kernel

        if bucket.plan["kind"] == "adam":
            dummy = flags if flags is not None else torch.zeros(1, dtype=torch.int32, device=bucket.params[0].device)
            advance_steps_kernel[(len(bucket.params),)](bucket.steps_table(bucket.params[0].device), dummy,
                                                        CHECK_FINITE=flags is not None)

    def launch(self, bucket: "Bucket") -> None:
        self.launch_all([bucket])

    def _launch_kernels(self, bucket: "Bucket", flags=None, advance: bool = True) -> None:
        """One launch of the update kernel over a bucket. ``flags``: per-parameter NaN/inf
        flags computed beforehand (streamed chunks); otherwise computed here."""
        from .kernels import launch
        from .kernels.adam import adam_kernel
        from .kernels.sgd import sgd_kernel

        engine, plan, params = self.engine, bucket.plan, bucket.params
        device, n = params[0].device, len(params)
        group = engine.inner.param_groups[bucket.group_index]
        nblk, warps = (NBLK_4BIT, NUM_WARPS_4BIT) if INT4 in plan["kinds"] else (NBLK, NUM_WARPS)
        cols, nbr, nblocks, prog_start, n_t, tpow2, n_prog = launch.work_tables(bucket.shapes, nblk, device)
        P = launch.pointer_table(params, device)
        G = launch.pointer_table(bucket.grad_list(), device)
        # counter-hash seeds of m, v, vmax and the parameter; the kernel mixes in the step
        SEEDS = launch.cached_table(self._seeds(bucket.indices, plan["keys"]), device)
        step_mix_value = step_mix(engine.step_count)
        BASE = launch.cached_table(bucket.bases, device)
        aligned, check = bucket.aligned, engine.skip_nonfinite
        if check and flags is None:
            flags = self._nonfinite_flags(bucket)
        elif check:
            flags = flags[bucket.param_index(device)]  # per piece: its parameter's flag
        if flags is None:
            flags = torch.zeros(1, dtype=torch.int32, device=device)
        p_kind = P_KINDS[params[0].dtype]
        lr = group["lr"]
        lr_tensor = isinstance(lr, torch.Tensor)
        lr_ptr = lr if lr_tensor else flags
        lr_val = 0.0 if lr_tensor else float(lr)
        m_codec = plan["codecs"][0]
        M, MS = bucket.tables(0, device)
        idx32 = all(b + r * c < 2**32 for b, r, c in zip(bucket.bases, bucket.rows, bucket.cols))
        common = dict(NBLK=nblk, ALIGNED=aligned, IDX32=idx32, num_warps=warps, CHECK_FINITE=check,
                      LR_TENSOR=lr_tensor,
                      FIRST=bucket.first, P_KIND=p_kind, MAXIMIZE=bool(group.get("maximize")))
        if plan["kind"] == "adam":
            v_codec = plan["codecs"][1]
            V, VS = bucket.tables(1, device)
            amsgrad = len(plan["keys"]) == 3
            VM, VMS = bucket.tables(2, device) if amsgrad else (V, VS)
            STEPS = bucket.steps_table(device)
            beta1, beta2 = (float(b) for b in group["betas"])
            decoupled = group.get("decoupled_weight_decay", isinstance(engine.inner, torch.optim.AdamW))
            adam_kernel[(n_prog,)](
                P, G, M, MS, V, VS, VM, VMS, STEPS, flags, SEEDS, step_mix_value, BASE, cols, nbr, nblocks, prog_start, n_t, tpow2,
                lr_ptr, lr_val, beta1, beta2, math.log(beta1) if beta1 > 0 else -1e30,
                math.log(beta2) if beta2 > 0 else -1e30, 1.0 - beta1, 1.0 - beta2,  # in float64 on the host
                float(group["eps"]), float(group["weight_decay"]),
                *self._tables(m_codec, device), *self._tables(v_codec, device),
                M_KIND=plan["kinds"][0], V_KIND=plan["kinds"][1],
                M_SR=bool(m_codec.stochastic_rounding), V_SR=bool(v_codec.stochastic_rounding),
                P_SR=self.stochastic_param_rounding and p_kind == 1,
                M_LEVELS=self._n_levels(m_codec), V_LEVELS=self._n_levels(v_codec),
                M_INV_POW=self._inv_power(m_codec), V_INV_POW=self._inv_power(v_codec),
                AMSGRAD=amsgrad, DECOUPLED=bool(decoupled), FAST_MATH=FAST_MATH, **common)
            if advance:
                self._advance_steps(bucket, flags if check else None)
        else:
            sgd_kernel[(n_prog,)](
                P, G, M, MS, flags, SEEDS, step_mix_value, BASE, cols, nbr, nblocks, prog_start, n_t, tpow2,
                lr_ptr, lr_val, float(group["momentum"]), float(group["dampening"]), float(group["weight_decay"]),
                *self._tables(m_codec, device), M_KIND=plan["kinds"][0], M_SR=bool(m_codec.stochastic_rounding),
                M_LEVELS=self._n_levels(m_codec), M_INV_POW=self._inv_power(m_codec), NESTEROV=bool(group["nesterov"]),
                **common)
        bucket.first = False if advance else bucket.first
        engine.metrics.fused_params += n if advance else 0
        engine.metrics.kernel_launches += 1

    def _seeds(self, indices, keys):
        """Counter-hash seeds per (parameter index, state), computed once."""
        names = (list(keys) + [keys[-1]] * 3)[:3] + ["param"]
        cache = self.__dict__.setdefault("_seed_cache", {})
        out = []
        for i in indices:
            for name in names:
                if (i, name) not in cache:
                    cache[(i, name)] = state_seed(self.engine.seed, i, name)
                out.append(cache[(i, name)])
        return out

    @staticmethod
    def _inv_power(codec) -> float:
        return 1.0 / codec.effective_power if isinstance(codec, Int4Codec) else 0.5

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


def _aligned(p: torch.Tensor) -> bool:
    """Rows are whole 256-element tiles and offsets fit in int32: the kernels' fast layout."""
    rows = p.shape[0] if p.dim() >= 2 else 1
    return p.numel() % rows == 0 and (p.numel() // max(rows, 1)) % 256 == 0 and p.numel() < 2**31 - 2**20


def _byte_view(t: torch.Tensor, start: int, nbytes: int) -> torch.Tensor:
    """A flat uint8 view of ``nbytes`` bytes of ``t``'s storage from byte offset ``start``."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage(), start, (nbytes,))


def _coalesce(pairs):
    """Merge (host, ring) tensor pairs whose bytes follow each other on both sides (up to the
    16-byte padding both layouts use) into single byte-range pairs."""
    out, run = [], None  # run: [host storage, host start, ring storage, ring start, end offset, first pair]
    for host, ring in pairs:
        if not host.numel():
            continue
        hs = host.storage_offset() * host.element_size()
        rs = ring.storage_offset() * ring.element_size()
        n = host.numel() * host.element_size()
        padded = -(-n // 16) * 16
        if (run is not None and host.untyped_storage().data_ptr() == run[0] and
                ring.untyped_storage().data_ptr() == run[2] and hs - run[1] == rs - run[3] and hs == run[4]
                and host.is_contiguous()):
            run[4] = hs + padded
            run[6] = hs + n
            continue
        if run is not None:
            out.append(run)
        run = [host.untyped_storage().data_ptr(), hs, ring.untyped_storage().data_ptr(), rs, hs + padded,
               (host, ring), hs + n]
    if run is not None:
        out.append(run)
    merged = []
    for hptr, hs, rptr, rs, _, (host, ring), hend in out:
        merged.append((_byte_view(host, hs, hend - hs), _byte_view(ring, rs, hend - hs)))
    return merged


class Bucket:
    """One kernel launch's worth of parameters (same group, codecs, dtype, layout)."""

    def __init__(self, works, storages, plan):
        self.keys = [w.key for w in works]
        self.params = [w.param for w in works]
        self.states = [w.state for w in works]
        self.indices = [w.info.index for w in works]
        self.group_index = works[0].info.group_index
        self.shapes = [tuple(p.shape) for p in self.params]
        self.rows = [w.rows for w in works]
        self.cols = [w.cols for w in works]
        self.bases = [w.offset for w in works]  # index of each item's first element in its global tensor
        self.grads = None  # None: the parameters' own .grad
        self.storages = storages
        self.plan = plan
        self.first = plan["first"]
        self.aligned = _aligned(self.params[0])
        self._tables = {}
        self._param_index = None

    def grad_list(self):
        """The current gradients (read each step: they may be new tensors every step)."""
        return self.grads if self.grads is not None else [local(k.grad) for k in self.keys]

    def param_index(self, device):
        """For a piece bucket: each piece's parameter index in the parent bucket (device table)."""
        from .kernels import launch
        return launch.cached_table(self._param_index, device)

    def sub(self, pieces, storages) -> "Bucket":
        """The same launch over row pieces ``(i, r0, r1)`` of its parameters, with other state
        storages (the staged copies): views of the parameter and gradient rows."""
        sub = object.__new__(Bucket)
        sub.keys = [self.keys[i] for i, _, _ in pieces]
        sub.params = [self.params[i].detach().view(self.rows[i], self.cols[i])[r0:r1] for i, r0, r1 in pieces]
        grads = self.grad_list()
        sub.grads = [grads[i].view(self.rows[i], self.cols[i])[r0:r1] for i, r0, r1 in pieces]
        sub.states = [self.states[i] for i, _, _ in pieces]
        sub.indices = [self.indices[i] for i, _, _ in pieces]
        sub.shapes = [(r1 - r0, self.cols[i]) for i, r0, r1 in pieces]
        sub.rows = [r1 - r0 for _, r0, r1 in pieces]
        sub.cols = [self.cols[i] for i, _, _ in pieces]
        sub.bases = [self.bases[i] + r0 * self.cols[i] for i, r0, _ in pieces]
        sub.group_index, sub.plan, sub.first, sub.aligned = self.group_index, self.plan, self.first, self.aligned
        sub.storages = storages
        sub._tables = {}
        sub._param_index = [i for i, _, _ in pieces]
        return sub

    def piece_bytes(self, piece) -> int:
        i, r0, r1 = piece
        return sum(-(-t[r0:r1].numel() * t.element_size() // 16) * 16
                   for enc in self.storages[i] for t in enc.payload.values())

    def chunks(self, idx, capacity: int):
        """Consecutive row pieces of parameters ``idx`` grouped so that each group's staged
        state fits ``capacity`` bytes; a parameter too large for one group is split by rows."""
        out, cur, used = [], [], 0
        for i in idx:
            total = self.piece_bytes((i, 0, self.rows[i]))
            per_row = max(1, -(-total // max(self.rows[i], 1)))
            r = 0
            while r < self.rows[i]:
                room = capacity - used
                take = min(self.rows[i] - r, max(room // per_row, 0))
                if take <= 0:
                    if cur:
                        out.append(cur)
                        cur, used = [], 0
                        continue
                    take = min(self.rows[i] - r, max(1, capacity // per_row))
                piece = (i, r, r + take)
                cur.append(piece)
                used += self.piece_bytes(piece)
                r += take
        if cur:
            out.append(cur)
        return out

    def tables(self, i: int, device):
        """Pointer tables (data, scales) of the i-th state of every parameter (built once: the
        engine re-plans whenever a state object changes)."""
        if i not in self._tables:
            self._tables[i] = self._build_tables(i, device)
        return self._tables[i]

    def _build_tables(self, i: int, device):
        from .kernels import launch
        values = [s[i] for s in self.storages]
        if isinstance(values[0], EncodedTensor):
            name = "codes" if "codes" in values[0].payload else "data"
            return (launch.pointer_table([v.payload[name] for v in values], device),
                    launch.pointer_table([v.payload.get("scales") for v in values], device))
        return launch.pointer_table(values, device), launch.pointer_table([None] * len(values), device)

    def steps_table(self, device):
        if "steps" not in self._tables:
            from .kernels import launch
            self._tables["steps"] = launch.pointer_table([st["step"] for st in self.states], device)
        return self._tables["steps"]


_DUMMIES: Dict[str, torch.Tensor] = {}


def _dummy(device) -> torch.Tensor:
    key = str(device)
    if key not in _DUMMIES:
        _DUMMIES[key] = torch.zeros(16, dtype=torch.float32, device=device)
    return _DUMMIES[key]
