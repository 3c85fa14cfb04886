"""The prepared-optimizer hook: bind a VirtualOptimizer to an Accelerator's gradient state."""
from __future__ import annotations

import logging
import weakref
from typing import Optional

import torch

import optstate_core as oc

from .metrics import log_metrics
from .prepared import check_accelerator, unwrap_optimizer

log = logging.getLogger("optstate.accelerate")

# optimizer -> its attachment, both held weakly: an attachment refers to its accelerator, which refers to
# the prepared optimizer, so a strong value would keep the optimizer, model and accelerator alive forever.
# The attachment lives as long as what it installed (the optimizer's post-step hook, the accelerator's
# clip_grad_norm_) or the caller's reference.
_attachments: "weakref.WeakKeyDictionary[oc.VirtualOptimizer, weakref.ref]" = weakref.WeakKeyDictionary()


def _current(optimizer) -> "Optional[Attachment]":
    ref = _attachments.get(optimizer)
    return ref() if ref is not None else None


class SyncGradients:
    """``source()`` for :meth:`VirtualOptimizer.bind_step_boundary`: Accelerate's ``sync_gradients``.

    ``Accelerator.accumulate`` sets it on entry, before the micro-batch's forward and backward,
    to whether that micro-batch ends in an optimizer step (the last of a window, or the last
    batch of a prepared dataloader); outside ``accumulate`` it stays True. The GradientState is a
    process-wide shared state, so the value is the one the AcceleratedOptimizer will act on.
    """

    def __init__(self, gradient_state):
        self.gradient_state = gradient_state

    def __call__(self) -> bool:
        # After GradientState._reset_state() the shared dict is empty until the next Accelerator.
        return bool(getattr(self.gradient_state, "sync_gradients", True))


class Attachment:
    """What :func:`attach` set up on one optimizer; :meth:`detach` undoes it."""

    def __init__(self, accelerator, optimizer: oc.VirtualOptimizer, log_every: Optional[int], prefix: str):
        self.accelerator = accelerator
        self.optimizer = optimizer
        self.log_every = log_every
        self.prefix = prefix
        self.source = SyncGradients(accelerator.gradient_state)
        self._hook = None

    def _install(self) -> None:
        self.optimizer.bind_step_boundary(self.source)
        if self.log_every is not None:
            self._hook = self.optimizer.register_step_post_hook(self._after_step)
        if self.optimizer.release_gradients and self.accelerator is not None:
            self.accelerator.clip_grad_norm_ = self._routed_clip_grad_norm  # this accelerator only

    def _routed_clip_grad_norm(self, parameters, max_norm, norm_type=2):
        """``accelerator.clip_grad_norm_`` when the optimizer releases gradients: they were
        applied and freed in backward, so clipping after backward is the optimizer's job. A call
        at the optimizer's ``max_grad_norm`` (or ``inf``, a norm query) returns this step's
        pre-clip global norm; anything else cannot be honoured and raises."""
        opt = self.optimizer
        if float(norm_type) != 2.0:
            raise ValueError(f"clip_grad_norm_: norm_type={norm_type} cannot be applied with release_gradients=True; "
                             "the optimizer clips 2-norms (max_grad_norm)")
        if max_norm != float("inf") and opt.max_grad_norm != max_norm:
            raise ValueError(f"clip_grad_norm_(max_norm={max_norm}): gradients are applied and freed in backward "
                             f"(release_gradients=True), so clipping must be set beforehand: "
                             f"optstate_accelerate.attach(accelerator, optimizer, max_grad_norm={max_norm}) or "
                             f"optstate_core.wrap(..., max_grad_norm={max_norm}) (the optimizer clips at "
                             f"{opt.max_grad_norm})")
        norm = opt.grad_norm_so_far
        return norm if norm is not None else torch.zeros(())

    def _after_step(self, optimizer, args, kwargs) -> None:
        if self.accelerator is not None and self.optimizer.step_count % self.log_every == 0:
            log_metrics(self.accelerator, self.optimizer, prefix=self.prefix)

    def detach(self) -> None:
        """Unbind the step boundary and stop logging (the optimizer keeps working as before)."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self.accelerator is not None and self.accelerator.__dict__.get("clip_grad_norm_") == \
                self._routed_clip_grad_norm:
            del self.accelerator.clip_grad_norm_
        if _current(self.optimizer) is self:
            self.optimizer.bind_step_boundary(None)
            del _attachments[self.optimizer]

    def __getstate__(self):
        # A copied or unpickled optimizer carries this hook: keep it inert, without the accelerator.
        return dict(self.__dict__, accelerator=None, _hook=None)

    def __repr__(self) -> str:
        return f"Attachment(log_every={self.log_every}, prefix={self.prefix!r})"


def attach(accelerator, optimizer, *, log_every: Optional[int] = None, prefix: str = "optstate/",
           max_grad_norm: Optional[float] = None) -> Attachment:
    """Make a (prepared) optstate optimizer follow ``accelerator``; call once after ``prepare``.

    - The optimizer reads its step boundary from ``accelerator.gradient_state.sync_gradients``,
      so backward-time prefetch of offloaded state runs only on micro-batches that end in an
      optimizer step under ``accelerator.accumulate(model)``.
    - With ``log_every=N``, :func:`log_metrics` runs after every N-th optimizer step (skipped
      steps, e.g. fp16 overflow, do not count), with ``step=`` the optimizer's step count.

    - With ``release_gradients=True`` on the optimizer, gradients are applied and freed in
      backward: ``max_grad_norm`` sets the optimizer's clipping, and ``accelerator.clip_grad_norm_``
      is routed to it (a call at that norm returns the step's norm; another norm raises). The
      backward hooks move to the parameters FSDP2's prepare swapped in (``rebind_parameters``).
    Attaching again replaces the previous attachment of the same optimizer. Returns an
    :class:`Attachment` whose ``detach()`` undoes all of it.
    """
    check_accelerator(accelerator)
    vopt = unwrap_optimizer(optimizer)
    if log_every is not None and (isinstance(log_every, bool) or not isinstance(log_every, int) or log_every < 1):
        raise ValueError(f"log_every must be None or an int >= 1, got {log_every!r}")
    if not isinstance(prefix, str):
        raise ValueError(f"prefix must be a string, got {type(prefix).__name__}")
    if max_grad_norm is not None:
        vopt.max_grad_norm = max_grad_norm  # validates (ValueError names max_grad_norm)
    vopt.rebind_parameters()  # FSDP2: prepare() swapped in the sharded parameters after wrap()
    previous = _current(vopt)
    if previous is not None:
        previous.detach()
    attachment = Attachment(accelerator, vopt, log_every, prefix)
    attachment._install()
    _attachments[vopt] = weakref.ref(attachment)
    log.debug("attached %s to the accelerator (log_every=%s)", type(vopt).__name__, log_every)
    return attachment


__all__ = ["attach", "Attachment", "SyncGradients"]
