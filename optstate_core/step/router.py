"""The router: which path steps each parameter, decided in one place for ``step()`` and for the
gradient-release hook alike.

The paths: the fused kernels (compressed or offloaded state, and uncompressed state beside it),
the inner optimizer's own step on uncompressed device state ("passthrough", bit-identical to the
unwrapped optimizer), the CPU fast path (Adam/AdamW on encoded CPU state) and the tiled reference
path (everything else: a first step, a codec switch, other optimizers). A parameter takes the same
path whether it is stepped with all the others in ``step()`` or alone in its backward hook, so
release equals no release bit for bit.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, TYPE_CHECKING, Tuple

from .context import Conformance, Residency, StepContext
from .cpu_step import CpuPlan, plan_cpu_fast
from .work import Work

if TYPE_CHECKING:  # annotations only
    from .fused import FusedPath


@dataclass
class Routes:
    """The works of one step (or one hook) sorted onto their paths; nothing is stepped yet."""
    fused: List[Tuple[Work, dict]] = field(default_factory=list)
    passthrough: List[Work] = field(default_factory=list)
    cpu: List[CpuPlan] = field(default_factory=list)
    tiled: List[Work] = field(default_factory=list)


class Router:
    """Sorts works onto paths with the conformance seam, the fused path and the policy."""

    def __init__(self, ctx: StepContext, conformance: Conformance, residency: Residency, fused: FusedPath):
        self.ctx, self.conformance, self.residency, self.fused = ctx, conformance, residency, fused
        self._beside = None  # (key, answer) of beside_compressed

    def route(self, works: List[Work]) -> Routes:
        routes, uncompressed = Routes(), []
        for w in works:
            if not self.conformance.needs_tiles(w) and self.ctx.policy.master_codec(w.info) is None:
                uncompressed.append(w)
                continue
            plan = self.fused.plan(w)
            (routes.fused.append((w, plan)) if plan is not None else routes.tiled.append(w))
        if uncompressed:
            # uncompressed tensors of an optimizer whose compressed ones the kernels step go into the
            # same launches (no second optimizer, no host synchronisation); so do those the kernel
            # steps exactly as torch's fused Adam(W) (NaN/inf skipped per block)
            beside = self.beside_compressed()
            for w in uncompressed:
                plan = self.fused.takes_uncompressed(w, beside)
                (routes.fused.append((w, plan)) if plan is not None else routes.passthrough.append(w))
        routes.cpu, routes.tiled = plan_cpu_fast(self.ctx, self.residency, routes.tiled)
        return routes

    def beside_compressed(self) -> bool:
        """Whether the policy may compress (or keep master weights for) any parameter of the
        optimizer now: then the kernels take its uncompressed tensors too. One answer for the
        whole optimizer, whichever parameters a call routes; cached while the policy's decisions
        and the groups' sizes stay the same."""
        ctx, step = self.ctx, self.ctx.step_count
        key = (ctx.policy.decision_key(step), tuple(len(g["params"]) for g in ctx.inner.param_groups))
        if self._beside is None or self._beside[0] != key:
            answer = any(ctx.policy.may_compress(info, step) for _, info in ctx.param_infos())
            self._beside = (key, answer)
        return self._beside[1]
