"""Kernel launches for one bucket: the fused update of its optimizer (``fused_optimizers/``), NaN/inf
flags, step counters.

One launch covers every parameter of a bucket. A 256-element block whose gradient holds a NaN/inf
is skipped inside the update kernel (README: NaN/inf gradients) and its parameter's flag raised,
so a fused step never synchronises with the host and needs no collective.
"""
from __future__ import annotations

import contextlib
from typing import Dict, Optional

import torch

from ..state.codecs.rounding import state_seed
from .context import StepContext
from .kernels import compile_ahead, launch

P_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# launch shape (256-element tiles per program, warps, tiles looped over per program, register cap),
# timed with the step table and ``optstate bench --tune`` (docs/benchmarks-journal.md sections 10, 11, 15, 19):
# int8 states 4 tiles x 2 warps (0.57x vs 0.61x fused AdamW at 2 x 2, H100 2026-11-23), looped
# twice (H200 2026-11-26: 5.04 vs 5.21 ms with the step queued ahead; register caps no faster); bf16
# 2 x 2 (4 x 2 and loops no faster); the Adam step of 4-bit states without master weights 1 x 1
# (section 15: 6.51 vs 6.91 ms at 2 x 2, H100), looped 16 times and capped at 64 registers (no
# spills; 32 one-warp programs per SM instead of 25 at its 80): H200 5.18 vs 5.49 ms uncapped, 5.84
# (and 6.24 at the previous 4-bit rounding code) unlooped. The option ``tuning.launch_shapes`` overrides
# them per kind, and its environment defaults every kind's value (docs/environment.md), read at wrap().
LAUNCH_SHAPES = {  # state kind -> (NBLK, num_warps, ITERS, maxnreg) of the Adam kernel (SGD: no loops)
    "int8": (4, 2, 2, 0),
    "int4": (1, 1, 16, 64),
    "other": (2, 2, 1, 0),
}


def launch_shape(plan, shapes: Dict[str, tuple]) -> tuple:
    """(NBLK, num_warps, ITERS, maxnreg or None) for a bucket's plan, by its most compressed state
    (``FusedOptimizer.shape_kind``; only a looping kernel takes ITERS)."""
    nblk, warps, iters, regs = shapes[plan.optimizer.shape_kind(plan)]
    return nblk, warps, iters if plan.optimizer.loops else 1, regs or None


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


class KernelLauncher:
    """Launches the Triton kernels over buckets; counts NaN/inf skips on the device."""

    def __init__(self, ctx: StepContext, stochastic_param_rounding: bool, fast_math: bool = True,
                 shapes: Optional[Dict[str, tuple]] = None, ahead: bool = True):
        """``shapes``: ``tuning.launch_shapes`` (default :data:`LAUNCH_SHAPES`); ``ahead``: ``tuning.compile_ahead``."""
        self.ctx = ctx
        self.stochastic_param_rounding = stochastic_param_rounding
        self._skipped: Optional[torch.Tensor] = None  # parameters skipped so far (device counter)
        self._flags = []  # this step's launches' flags, added to the counter once (end_step)
        self._factors: Optional[dict] = None  # gradient release's clip factors (clip_factors)
        self._seed_cache: Dict[tuple, int] = {}
        self._step_counts: Dict[torch.device, list] = {}  # device -> [int64 0-d tensor, host step it holds]
        self.group_scalars: Dict[int, dict] = {}  # schedule-free AdamW: this step's values per group
        self.compile_ahead = compile_ahead.enabled(ahead)  # variants compiled on a thread ahead of their launches
        self.fast_math = fast_math
        self.shapes = dict(LAUNCH_SHAPES if shapes is None else shapes)

    def close(self) -> None:
        """Forget cached launch tables (they hold device pointers of freed state)."""
        launch.clear_caches()
        self._step_counts.clear()

    def step_count(self, device) -> torch.Tensor:
        """The optimizer's step count on ``device`` (the kernels derive the rounding stream's step
        from it). Set from the host only when the host count moved without it (first use, a loaded
        checkpoint); otherwise :meth:`end_step` advances it on the device, inside a captured graph too."""
        entry = self._step_counts.get(device)
        host = self.ctx.step_count
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
            if entry[1] == self.ctx.step_count:
                entry[0].add_(1)
                entry[1] += 1

    def new_flags(self, bucket):
        """Zeroed per-parameter flags that the kernels raise for a parameter with a block skipped
        for a non-finite gradient (None when unchecked). No pre-pass, no host synchronisation, no
        collective: each rank decides for the blocks it holds (README: NaN/inf gradients)."""
        if not self.ctx.options.skip_nonfinite:
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
        bucket.plan.optimizer.advance_steps(self, bucket)

    def launch(self, bucket, flags=None, advance: bool = True) -> None:
        """One launch of the update kernel over a bucket. ``flags``: the parent bucket's
        per-parameter NaN/inf flags (streamed chunks, counted by the caller); otherwise the
        launch has and counts its own. ``advance``: the step counts too (streamed pieces leave
        that to :meth:`advance_steps` after the last piece)."""
        entry, n, metrics = bucket.plan.optimizer, len(bucket.params), self.ctx.metrics
        check, device = self.ctx.options.skip_nonfinite, bucket.params[0].device
        # a piece bucket over the parent's parameters in its order raises the parent's flags itself
        # (the kernels only ever store 1: the same as the scatter's maximum of fresh flags)
        direct = check and flags is not None and bucket.parent_order
        ctx = self._context(bucket, flags, direct, advance)
        args, kwargs = entry.arguments(self, bucket, ctx)
        self._run(entry.kernel(), ctx.n_prog, device, args, kwargs)
        if check and flags is None:
            self.count_skipped(ctx.flags)
        elif check and not direct:  # a streamed piece: raise its parameter's flag (the caller counts them)
            flags.scatter_reduce_(0, bucket.param_index(device), ctx.flags, "amax")
        bucket.first = False if advance else bucket.first
        metrics.fused_params += n if advance else 0
        metrics.kernel_launches += 1

    def _context(self, bucket, parent_flags, direct: bool, advance: bool) -> "Launch":
        """What the update kernels' launch over ``bucket`` shares: its shape, tables, this launch's
        NaN/inf flags (the parent's with ``direct``) and the constexprs every kernel takes."""
        plan, params, check = bucket.plan, bucket.params, self.ctx.options.skip_nonfinite
        device, n = params[0].device, len(params)
        group = self.ctx.inner.param_groups[bucket.group_index]
        nblk, warps, iters, maxnreg = launch_shape(plan, self.shapes)
        iters = loops_for(bucket.tiles, nblk, iters, warps, device)
        memo, memo_key = bucket.memo(device), ("launch", nblk * iters)  # per-bucket constants, kept with the bucket
        if memo_key not in memo:
            # shape tables; counter-hash seeds of m, v, vmax and the parameter (the kernel mixes in
            # the step); each item's first element; whether offsets fit 32 bits
            memo[memo_key] = (launch.work_tables(bucket.shapes, nblk * iters, device),
                              launch.cached_table(self._seeds(bucket.indices, plan.keys), device),
                              launch.cached_table(bucket.bases, device),
                              all(b + r * c < 2**32 for b, r, c in zip(bucket.bases, bucket.rows, bucket.cols)))
        (cols, nbr, nblocks, prog_start, n_t, tpow2, n_prog), SEEDS, BASE, idx32 = memo[memo_key]
        STEP = self.step_count(device)
        flags = parent_flags if direct else self.new_flags(bucket) if check else _dummy(device, torch.int32)
        p_kind = P_KINDS[params[0].dtype]
        lr = group["lr"]
        lr_tensor = isinstance(lr, torch.Tensor)
        M, MS = bucket.tables(0, device, memo)
        common = dict(NBLK=nblk, ALIGNED=bucket.aligned, IDX32=idx32, num_warps=warps, CHECK_FINITE=check,
                      LR_TENSOR=lr_tensor, FIRST=bucket.first, P_KIND=p_kind, MAXIMIZE=bool(group.get("maximize")))
        factors = self._factors  # gradient release's clip factors, applied as the gradients are read
        # parameters, gradients (new every step, maybe) and clip factors: one table, one copy when any moved
        P, G, GS = launch.cached_tables((bucket.param_pointers(), bucket.grad_pointers(),
                                         [f.data_ptr() + 4 * i for f, i in (factors[id(k)] for k in bucket.keys)]
                                         if factors is not None else [_one(device).data_ptr()] * n), device)
        return Launch(bucket, group, device, memo, n_prog, (P, G, GS, M, MS),
                      (flags, SEEDS, STEP, BASE, cols, nbr, nblocks, prog_start, n_t, tpow2),
                      lr if lr_tensor else flags, 0.0 if lr_tensor else float(lr), common, iters, maxnreg, advance)

    def _run(self, kernel, n_prog: int, device, args: tuple, kwargs: dict) -> None:
        """Launch ``kernel`` over ``n_prog`` programs; with compiling ahead on, wait for its variant
        if the worker is compiling it, and after a first-step launch queue its later-step twin
        (kernels/compile_ahead.py)."""
        if self.compile_ahead and compile_ahead.busy():
            compile_ahead.wait_for(compile_ahead.variant_key(kernel, args, kwargs))
        kernel[(n_prog,)](*args, **kwargs)
        if self.compile_ahead and kwargs.get("FIRST"):
            compile_ahead.twin(kernel, args, kwargs, device)

    def _seeds(self, indices, keys):
        """Counter-hash seeds per (parameter index, state), computed once."""
        names = (list(keys) + [keys[-1]] * 3)[:3] + ["param"]
        cache = self._seed_cache
        out = []
        for i in indices:
            for name in names:
                if (i, name) not in cache:
                    cache[(i, name)] = state_seed(self.ctx.options.seed, i, name)
                out.append(cache[(i, name)])
        return out


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


class Launch:
    """What one update-kernel launch over a bucket shares, for its optimizer's ``arguments``: the
    leading tables ``heads`` (parameters, gradients, clip factors, the first state's data and
    scales), the tables after the states ``tail`` (NaN/inf flags, seeds, step, bases, work tables),
    the learning rate as a pointer and a value, and the constexprs every kernel takes."""

    __slots__ = ("bucket", "group", "device", "memo", "n_prog", "heads", "tail", "lr_ptr", "lr_val", "common",
                 "iters", "maxnreg", "advance")

    def __init__(self, bucket, group, device, memo, n_prog, heads, tail, lr_ptr, lr_val, common, iters, maxnreg,
                 advance):
        self.bucket, self.group, self.device, self.memo, self.n_prog = bucket, group, device, memo, n_prog
        self.heads, self.tail, self.lr_ptr, self.lr_val = heads, tail, lr_ptr, lr_val
        self.common, self.iters, self.maxnreg, self.advance = common, iters, maxnreg, advance

    @property
    def flags(self) -> torch.Tensor:
        return self.tail[0]

    def state(self, i: int) -> tuple:
        """(data, scales) pointer tables of the bucket's ``i``-th state."""
        return self.bucket.tables(i, self.device, self.memo)

    def common_without(self, *names) -> dict:
        """The common constexprs less those a kernel does not take."""
        return {k: v for k, v in self.common.items() if k not in names}

    def codec_tables(self, codec) -> tuple:
        """A state's (levels, midpoints, decode table) arguments: its codec's, else unread stand-ins."""
        tables = codec.kernel_tables(self.device)
        return tables if tables is not None else (_dummy(self.device),) * 3

    @staticmethod
    def codec_constexprs(prefix: str, codec, kind) -> dict:
        """A state's constexprs ``{prefix}_KIND``, ``_SR``, ``_LEVELS``, ``_INV_POW``, ``_POW``."""
        levels, inv_pow, int_pow = codec.kernel_constants()
        return {f"{prefix}_KIND": int(kind), f"{prefix}_SR": bool(codec.stochastic_rounding),
                f"{prefix}_LEVELS": levels, f"{prefix}_INV_POW": inv_pow, f"{prefix}_POW": int_pow}
