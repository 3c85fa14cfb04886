"""Kernel launches for one bucket: the fused update (Adam/AdamW/SGD/Lion/schedule-free AdamW), NaN/inf
flags, step counters.

One launch covers every parameter of a bucket. A 256-element block whose gradient holds a NaN/inf
is skipped inside the update kernel (README: NaN/inf gradients) and its parameter's flag raised,
so a fused step never synchronises with the host and needs no collective.
"""
from __future__ import annotations

import contextlib
import math
import os
from typing import Dict, Optional

import torch

from ..state.codecs import Int4Codec
from ..state.codecs.rounding import state_seed
from ..state.units import env_count
from .inner import decoupled_decay
from .kernels import compile_ahead, launch

FP32, BF16, INT8, INT4, FP24 = 0, 1, 2, 3, 4
P_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# launch shape (256-element tiles per program, warps, tiles looped over per program, register cap),
# timed with the step table and ``optstate bench --tune`` (docs/benchmarks-journal.md sections 10, 11, 15, 19):
# int8 states 4 tiles x 2 warps (0.57x vs 0.61x fused AdamW at 2 x 2, H100 2026-11-23), looped
# twice (H200 2026-11-26: 5.04 vs 5.21 ms with the step queued ahead; register caps no faster); bf16
# 2 x 2 (4 x 2 and loops no faster); the Adam step of 4-bit states without master weights 1 x 1
# (section 15: 6.51 vs 6.91 ms at 2 x 2, H100), looped 16 times and capped at 64 registers (no
# spills; 32 one-warp programs per SM instead of 25 at its 80): H200 5.18 vs 5.49 ms uncapped, 5.84
# (and 6.24 at the previous 4-bit rounding code) unlooped. Env vars override every kind's value
# (OPTSTATE_NBLK, OPTSTATE_NUM_WARPS, OPTSTATE_ITERS, OPTSTATE_MAXNREG; 0: no cap).
LAUNCH_SHAPES = {  # state kind -> (NBLK, num_warps, ITERS, maxnreg) of the Adam kernel (SGD: no loops)
    "int8": (4, 2, 2, 0),
    "int4": (1, 1, 16, 64),
    "other": (2, 2, 1, 0),
}


for _kind, _shape in LAUNCH_SHAPES.items():
    LAUNCH_SHAPES[_kind] = tuple(env_count(name, value, least) for name, value, least in zip(
        ("OPTSTATE_NBLK", "OPTSTATE_NUM_WARPS", "OPTSTATE_ITERS", "OPTSTATE_MAXNREG"), _shape, (1, 1, 1, 0)))


def launch_shape(plan) -> tuple:
    """(NBLK, num_warps, ITERS, maxnreg or None) for a bucket's plan, by its most compressed state
    (4-bit states with master weights take the general shape)."""
    kinds = plan["kinds"]
    if INT4 in kinds and plan["kind"] == "adam" and not plan.get("master"):
        nblk, warps, iters, regs = LAUNCH_SHAPES["int4"]
    elif INT8 in kinds and INT4 not in kinds:
        nblk, warps, iters, regs = LAUNCH_SHAPES["int8"]
    else:
        nblk, warps, iters, regs = LAUNCH_SHAPES["other"]
    return nblk, warps, iters if plan["kind"] == "adam" else 1, regs or None


#: resident warps an SM keeps for these kernels (Hopper: 64; the 4-bit shape's register cap allows 32 one-warp programs)
WARPS_PER_SM = 32


def loops_for(tiles: int, nblk: int, iters: int, warps: int, device) -> int:
    """The loop count of a launch over ``tiles`` 256-element tiles: the shape's ``iters``, halved
    while the launch would have fewer programs than one wave of the GPU (``WARPS_PER_SM / warps``
    per SM), as a launch of one parameter (gradient release) or a small bucket does: looping
    amortizes a program's setup over a whole model, but on one tensor it idles most SMs. Results
    do not depend on it (``tests/kernels``: tiles per program)."""
    if iters <= 1 or device.type != "cuda":
        return iters
    wave = _sm_count(device) * max(1, WARPS_PER_SM // warps)
    while iters > 1 and tiles < nblk * iters * wave:
        iters //= 2
    return max(iters, 1)


_SMS: Dict[torch.device, int] = {}


def _sm_count(device) -> int:
    count = _SMS.get(device)
    if count is None:
        count = _SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return count


def fast_math() -> bool:
    """``OPTSTATE_FAST_MATH``: hardware square root and reciprocal square root (a few ulp) in the
    Adam update (``1``, the default); anything else: correctly rounded ones. Read at wrap()."""
    return os.environ.get("OPTSTATE_FAST_MATH", "1") == "1"


class KernelLauncher:
    """Launches the Triton kernels over buckets; counts NaN/inf skips on the device."""

    def __init__(self, engine, stochastic_param_rounding: bool):
        self.engine = engine
        self.stochastic_param_rounding = stochastic_param_rounding
        self._skipped: Optional[torch.Tensor] = None  # parameters skipped so far (device counter)
        self._flags = []  # this step's launches' flags, added to the counter once (end_step)
        self._factors: Optional[dict] = None  # gradient release's clip factors (clip_factors)
        self._seed_cache: Dict[tuple, int] = {}
        self._step_counts: Dict[torch.device, list] = {}  # device -> [int64 0-d tensor, host step it holds]
        self.group_scalars: Dict[int, dict] = {}  # schedule-free AdamW: this step's values per group
        self.compile_ahead = compile_ahead.enabled()  # kernel variants compiled on a thread ahead of their launches
        self.fast_math = fast_math()

    def close(self) -> None:
        """Forget cached launch tables (they hold device pointers of freed state)."""
        launch.clear_caches()
        self._step_counts.clear()

    def step_count(self, device) -> torch.Tensor:
        """The optimizer's step count on ``device`` (the kernels derive the rounding stream's step
        from it). Set from the host only when the host count moved without it (first use, a loaded
        checkpoint); otherwise :meth:`end_step` advances it on the device, inside a captured graph too."""
        entry = self._step_counts.get(device)
        host = self.engine.step_count
        if entry is None:
            entry = self._step_counts[device] = [torch.zeros((), dtype=torch.int64, device=device), None]
        if entry[1] != host:
            entry[0].fill_(host)
            entry[1] = host
        return entry[0]

    @contextlib.contextmanager
    def clip_factors(self, factors: dict):
        """Launches inside multiply each gradient by its clip factor as they read it: ``factors``
        maps ``id(param)`` to ``(fp32 tensor, index)`` (gradient release's ``_clip``; the tensors
        stay alive until the launches are queued); outside, and for an empty map, by 1.0."""
        self._factors = factors or None
        try:
            yield
        finally:
            self._factors = None

    @property
    def nonfinite_device(self) -> Optional[torch.Tensor]:
        """Parameters skipped for NaN/inf gradients so far on the fused path (a device counter)."""
        self._fold_flags()
        return self._skipped

    @nonfinite_device.setter
    def nonfinite_device(self, value: Optional[torch.Tensor]) -> None:
        self._flags.clear()
        self._skipped = value

    def _fold_flags(self) -> None:
        if self._flags:
            flags, self._flags = self._flags, []
            if len({f.device for f in flags}) == 1:
                self.add_skipped(torch.cat(flags).sum())
            else:
                for f in flags:
                    self.add_skipped(f.sum())

    def end_step(self) -> None:
        """Advance the device step counts that this step's launches read (before the host count);
        add the step's raised flags to the skip counter (three launches a step, not two a launch)."""
        self._fold_flags()
        for entry in self._step_counts.values():
            if entry[1] == self.engine.step_count:
                entry[0].add_(1)
                entry[1] += 1

    def new_flags(self, bucket):
        """Zeroed per-parameter flags that the kernels raise for a parameter with a block skipped
        for a non-finite gradient (None when unchecked). No pre-pass, no host synchronisation, no
        collective: each rank decides for the blocks it holds (README: NaN/inf gradients)."""
        if not self.engine.skip_nonfinite:
            return None
        return torch.zeros(len(bucket.params), dtype=torch.int32, device=bucket.params[0].device)

    def count_skipped(self, flags) -> None:
        """Add a launch's raised flags to the device counter (at the end of the step, or when read)."""
        if flags is not None:
            self._flags.append(flags)

    def add_skipped(self, count: torch.Tensor) -> None:
        """Add skips counted on the device (a launch's flags, torch's own step in passthrough_skip)."""
        self._skipped = count if self._skipped is None else self._skipped + count

    def advance_steps(self, bucket) -> None:
        """Advance the bucket's per-parameter step counters on the device after its streamed
        pieces (blocks skipped for a non-finite gradient do not hold a parameter's step back)."""
        from .kernels.adam import advance_steps_kernel

        if bucket.plan["kind"] == "adam":
            device = bucket.params[0].device
            self._run(advance_steps_kernel, len(bucket.params), device, (bucket.steps_table(device, bucket.memo(device)),), {})

    def launch(self, bucket, flags=None, advance: bool = True) -> None:
        """One launch of the update kernel over a bucket. ``flags``: the parent bucket's
        per-parameter NaN/inf flags (streamed chunks, counted by the caller); otherwise the
        launch has and counts its own. ``advance``: the step counts too (streamed pieces leave
        that to :meth:`advance_steps` after the last piece)."""
        from .kernels.adam import adam_kernel
        from .kernels.lion import lion_kernel
        from .kernels.schedule_free import schedule_free_adamw_kernel
        from .kernels.sgd import sgd_kernel

        engine, plan, params = self.engine, bucket.plan, bucket.params
        device, n = params[0].device, len(params)
        group = engine.inner.param_groups[bucket.group_index]
        nblk, warps, iters, maxnreg = launch_shape(plan)
        iters = loops_for(bucket.tiles, nblk, iters, warps, device)
        memo, memo_key = bucket.memo(device), ("launch", nblk * iters)  # per-bucket constants, kept with the bucket
        if memo_key not in memo:
            # shape tables; counter-hash seeds of m, v, vmax and the parameter (the kernel mixes in
            # the step); each item's first element; whether offsets fit 32 bits
            memo[memo_key] = (launch.work_tables(bucket.shapes, nblk * iters, device),
                              launch.cached_table(self._seeds(bucket.indices, plan["keys"]), device),
                              launch.cached_table(bucket.bases, device),
                              all(b + r * c < 2**32 for b, r, c in zip(bucket.bases, bucket.rows, bucket.cols)))
        (cols, nbr, nblocks, prog_start, n_t, tpow2, n_prog), SEEDS, BASE, idx32 = memo[memo_key]
        STEP = self.step_count(device)
        aligned, check = bucket.aligned, engine.skip_nonfinite
        parent_flags = flags
        # a piece bucket over the parent's parameters in its order raises the parent's flags itself
        # (the kernels only ever store 1: the same as the scatter's maximum of fresh flags)
        direct = check and parent_flags is not None and bucket.parent_order
        flags = parent_flags if direct else self.new_flags(bucket) if check else _dummy(device, torch.int32)
        p_kind = P_KINDS[params[0].dtype]
        lr = group["lr"]
        lr_tensor = isinstance(lr, torch.Tensor)
        lr_ptr = lr if lr_tensor else flags
        lr_val = 0.0 if lr_tensor else float(lr)
        m_codec = plan["codecs"][0]
        M, MS = bucket.tables(0, device, memo)
        common = dict(NBLK=nblk, ALIGNED=aligned, IDX32=idx32, num_warps=warps, CHECK_FINITE=check,
                      LR_TENSOR=lr_tensor,
                      FIRST=bucket.first, P_KIND=p_kind, MAXIMIZE=bool(group.get("maximize")))
        factors = self._factors  # gradient release's clip factors, applied as the gradients are read
        # parameters, gradients (new every step, maybe) and clip factors: one table, one copy when any moved
        P, G, GS = launch.cached_tables((bucket.param_pointers(), bucket.grad_pointers(),
                                         [f.data_ptr() + 4 * i for f, i in (factors[id(k)] for k in bucket.keys)]
                                         if factors is not None else [_one(device).data_ptr()] * n), device)
        if plan["kind"] == "adam":
            v_codec = plan["codecs"][1]
            V, VS = bucket.tables(1, device, memo)
            amsgrad = len(plan["keys"]) == 3
            VM, VMS = bucket.tables(2, device, memo) if amsgrad else (V, VS)
            beta1, beta2 = (float(b) for b in group["betas"])
            decoupled = decoupled_decay(engine.inner, group)
            torch_fused = bool(plan.get("torch_fused"))
            CORR = self._bias_corrections(bucket, memo, lr_ptr, lr_val, lr_tensor, beta1, beta2, torch_fused, advance)
            self._run(adam_kernel, n_prog, device, (
                P, G, GS, M, MS, V, VS, VM, VMS, CORR, flags, SEEDS, STEP, BASE, cols, nbr, nblocks, prog_start, n_t,
                tpow2, lr_ptr, lr_val, beta1, beta2, 1.0 - beta1, 1.0 - beta2,  # in float64 on the host
                float(group["eps"]), float(group["weight_decay"]),
                *self._tables(m_codec, device), *self._tables(v_codec, device)), dict(
                M_KIND=plan["kinds"][0], V_KIND=plan["kinds"][1],
                M_SR=bool(m_codec.stochastic_rounding), V_SR=bool(v_codec.stochastic_rounding),
                P_SR=self.stochastic_param_rounding and p_kind == 1,
                M_LEVELS=self._n_levels(m_codec), V_LEVELS=self._n_levels(v_codec),
                M_INV_POW=self._inv_power(m_codec), V_INV_POW=self._inv_power(v_codec),
                M_POW=self._int_power(m_codec), V_POW=self._int_power(v_codec),
                AMSGRAD=amsgrad, DECOUPLED=bool(decoupled), FAST_MATH=self.fast_math, ITERS=iters, TORCH_FUSED=torch_fused,
                maxnreg=maxnreg, **self._master(bucket, device, memo), **common))
        elif plan["kind"] == "schedule_free":
            v_codec = plan["codecs"][1]
            V, VS = bucket.tables(1, device, memo)
            sc = self.group_scalars[bucket.group_index]
            self._run(schedule_free_adamw_kernel, n_prog, device, (
                P, G, GS, M, MS, V, VS, flags, SEEDS, STEP, BASE, cols, nbr, nblocks, prog_start, n_t, tpow2,
                sc["lr"], sc["ckp1"], sc["y_coef"], sc["bias_correction2"], sc["eps"], sc["beta2"],
                sc["one_minus_beta2"], sc["decay"], *self._tables(v_codec, device)), dict(
                Z_KIND=plan["kinds"][0], V_KIND=plan["kinds"][1], V_SR=bool(v_codec.stochastic_rounding),
                V_LEVELS=self._n_levels(v_codec), V_INV_POW=self._inv_power(v_codec), V_POW=self._int_power(v_codec),
                DECAY=sc["decay"] != 0, SMALL_WEIGHT=abs(sc["ckp1"]) < 0.5,
                **{k: v for k, v in common.items() if k not in ("LR_TENSOR", "MAXIMIZE")}))
        elif plan["kind"] == "lion":
            beta1, beta2 = (float(b) for b in group["betas"])
            wd = float(group["weight_decay"])
            if getattr(engine.inner, "decoupled_wd", False):
                wd /= engine.inner._init_lr
            self._run(lion_kernel, n_prog, device, (
                P, G, GS, M, MS, flags, SEEDS, STEP, BASE, cols, nbr, nblocks, prog_start, n_t, tpow2,
                1.0 - lr_val * wd, lr_val, beta1, beta2, 1.0 - beta1, 1.0 - beta2,  # in float64 on the host, as lion-pytorch
                *self._tables(m_codec, device)), dict(M_KIND=plan["kinds"][0], M_SR=bool(m_codec.stochastic_rounding),
                M_LEVELS=self._n_levels(m_codec), M_INV_POW=self._inv_power(m_codec), M_POW=self._int_power(m_codec),
                **{k: v for k, v in common.items() if k not in ("LR_TENSOR", "MAXIMIZE")}))
        else:
            self._run(sgd_kernel, n_prog, device, (
                P, G, GS, M, MS, flags, SEEDS, STEP, BASE, cols, nbr, nblocks, prog_start, n_t, tpow2,
                lr_ptr, lr_val, float(group["momentum"]), float(group["dampening"]), float(group["weight_decay"]),
                *self._tables(m_codec, device)), dict(M_KIND=plan["kinds"][0], M_SR=bool(m_codec.stochastic_rounding),
                M_LEVELS=self._n_levels(m_codec), M_INV_POW=self._inv_power(m_codec), M_POW=self._int_power(m_codec),
                NESTEROV=bool(group["nesterov"]), **common))
        if check and parent_flags is None:
            self.count_skipped(flags)
        elif check and not direct:  # a streamed piece: raise its parameter's flag (the caller counts them)
            parent_flags.scatter_reduce_(0, bucket.param_index(device), flags, "amax")
        bucket.first = False if advance else bucket.first
        engine.metrics.fused_params += n if advance else 0
        engine.metrics.kernel_launches += 1

    def _run(self, kernel, n_prog: int, device, args: tuple, kwargs: dict) -> None:
        """Launch ``kernel`` over ``n_prog`` programs; with compiling ahead on, wait for its variant
        if the worker is compiling it, and after a first-step launch queue its later-step twin
        (kernels/compile_ahead.py)."""
        if self.compile_ahead and compile_ahead.busy():
            compile_ahead.wait_for(compile_ahead.variant_key(kernel, args, kwargs))
        kernel[(n_prog,)](*args, **kwargs)
        if self.compile_ahead and kwargs.get("FIRST"):
            compile_ahead.twin(kernel, args, kwargs, device)

    def _bias_corrections(self, bucket, memo, lr_ptr, lr_val, lr_tensor, beta1, beta2, torch_fused,
                          advance) -> torch.Tensor:
        """The Adam kernel's CORR table for the coming step (and the step counts advanced, with
        ``advance``), from the per-parameter step counts on the device: per tensor the step size
        and square-rooted second correction (``bias_corrections_kernel``), or for torch's fused
        arithmetic ``[beta1**step, beta2**step]`` by torch's own device ``pow``, whose float32
        results differ from Triton's libdevice ``powf`` in the last bit for some steps. ``memo``:
        the bucket's tables on the current stream (:meth:`Bucket.memo`)."""
        from .kernels.adam import bias_corrections_kernel

        device, n = bucket.params[0].device, len(bucket.params)
        out = torch.empty(n if torch_fused else 3 * n, dtype=torch.float32, device=device)
        self._run(bias_corrections_kernel, n, device,
                  (bucket.steps_table(device, memo), out, lr_ptr, lr_val,
                   math.log(beta1) if beta1 > 0 else -1e30, math.log(beta2) if beta2 > 0 else -1e30),
                  dict(LR_TENSOR=lr_tensor, ADVANCE=advance, STEP_ONLY=torch_fused))
        if not torch_fused:
            return out
        key = (str(device), beta1, beta2)
        betas = _BETAS.get(key)
        if betas is None:
            betas = _BETAS[key] = torch.tensor([[beta1], [beta2]], dtype=torch.float32, device=device)
        return torch.pow(betas, out)  # [2, n]

    @staticmethod
    def _master(bucket, device, memo) -> dict:
        """Kernel arguments of the master-weight path (the correction's pointer table from the
        bucket's ``memo``, its bits); none when the bucket keeps no master weights."""
        bits = bucket.plan.get("master", 0)
        if not bits:
            return {}
        return {"C": bucket.tables(len(bucket.plan["keys"]), device, memo)[0], "MASTER": bits}

    def _seeds(self, indices, keys):
        """Counter-hash seeds per (parameter index, state), computed once."""
        names = (list(keys) + [keys[-1]] * 3)[:3] + ["param"]
        cache = self._seed_cache
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
    def _int_power(codec) -> int:
        """The 4-bit codec's integer power (arithmetic decode/encode in the kernels), else 0."""
        return codec.integer_power if isinstance(codec, Int4Codec) else 0

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


_BETAS: Dict[tuple, torch.Tensor] = {}
_DUMMIES: Dict[tuple, torch.Tensor] = {}


def _one(device) -> torch.Tensor:
    """An fp32 1.0: the clip factor of every gradient a launch does not clip (see ``scale_grad``)."""
    key = (str(device), "one")
    if key not in _DUMMIES:
        _DUMMIES[key] = torch.ones(1, dtype=torch.float32, device=device)
    return _DUMMIES[key]


def _dummy(device, dtype=torch.float32) -> torch.Tensor:
    """A small zero tensor for kernel arguments a launch does not read (tables, unchecked flags)."""
    key = (str(device), dtype)
    if key not in _DUMMIES:
        _DUMMIES[key] = torch.zeros(16, dtype=dtype, device=device)
    return _DUMMIES[key]
