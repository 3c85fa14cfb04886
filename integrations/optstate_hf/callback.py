"""``OptStateCallback``: warmup switching, accumulation boundaries and metrics in the Trainer's logs."""
from __future__ import annotations

import inspect
import logging
from typing import Optional

import optstate_core as oc
from transformers import TrainerCallback
from transformers.trainer_callback import CallbackHandler

log = logging.getLogger("optstate.hf")


def find_virtual_optimizer(optimizer) -> Optional[oc.VirtualOptimizer]:
    """The VirtualOptimizer inside the Trainer's optimizer (Accelerate's AcceleratedOptimizer
    keeps it as ``.optimizer``), or None (:func:`optstate_core.unwrap`)."""
    return oc.unwrap(optimizer)


def _run_first(callback) -> bool:
    """Put ``callback`` first in the CallbackHandler that is calling it.

    The Trainer appends user callbacks after the reporting integrations (TensorBoard, W&B, ...),
    so keys a callback adds to ``logs`` in ``on_log`` would reach none of them. The handler is
    not passed to callbacks; it is the ``self`` of ``CallbackHandler.call_event``, our caller.
    Moving ourselves from index i to 0 keeps the handler's running loop over the list intact
    (items after i keep their indices).
    """
    frame = inspect.currentframe()
    try:
        for _ in range(4):
            frame = frame.f_back if frame is not None else None
            handler = frame.f_locals.get("self") if frame is not None else None
            if isinstance(handler, CallbackHandler):
                callbacks = handler.callbacks
                index = next((i for i, cb in enumerate(callbacks) if cb is callback), None)
                if index is None:
                    return False
                if index:
                    callbacks.insert(0, callbacks.pop(index))
                return True
    finally:
        del frame
    return False


class OptStateCallback(TrainerCallback):
    """Connects an optstate optimizer to the HF Trainer.

    - Step boundaries: binds the optimizer to Accelerate's ``sync_gradients``, so the engine knows
      which micro-batch's backward ends in an optimizer step (prefetch of offloaded state runs
      only there).
    - Clipping: with ``release_gradients`` the Trainer's ``max_grad_norm`` goes to the optimizer
      (its own clipping after backward would see no gradient) and the Trainer's is turned off;
      the logged ``grad_norm`` (which the Trainer measures after backward, i.e. over no gradient,
      or on transformers 4.x does not log without its own clipping) is the optimizer's
      ``last_grad_norm``, the step's pre-clip global norm.
    - Warmup switching: feeds each logged training loss (``logs["loss"]``, averaged over ranks
      and so identical on all of them) to an ``AdaptiveWarmupPolicy``; the policy's phase is
      part of the optimizer's state_dict (``optimizer.pt``), so a resumed run stays in it.
    - Metrics: adds ``optimizer.log_metrics(prefix)`` (state MB on device and host, bits/param,
      step and overhead ms, ...) to every training log, so they reach ``log_history`` and the
      ``report_to`` integrations like any metric. To get there first it moves itself to the
      front of the Trainer's callback list.

    - Weight streaming (an optimizer wrapped with ``stream_weights=True``: ``optim="optstate_adamw_..._stream"``,
      ``optim_args="stream_weights=true"`` or a ``-stream`` preset; or ``stream_weights=True`` here): at the
      start of training the model's decoder layers go to host memory and stream through the GPU
      (``optstate_core.stream_weights``; docs/weight-streaming.md).

    Args:
        log_metrics: add the optimizer metrics to the logs.
        prefix: prefix of the metric names.
        feed_loss: feed logged losses to the policy (only policies that want them).
        stream_weights: stream the weights (None: as the optimizer's option ``stream_weights`` says).
    """

    def __init__(self, log_metrics: bool = True, prefix: str = "optstate/", feed_loss: bool = True,
                 stream_weights: Optional[bool] = None):
        if not isinstance(prefix, str):
            raise ValueError(f"prefix must be a string, got {prefix!r}")
        if stream_weights is not None and not isinstance(stream_weights, bool):
            raise ValueError(f"stream_weights must be None, True or False, got {stream_weights!r}")
        self.log_metrics = bool(log_metrics)
        self.prefix = prefix
        self.feed_loss = bool(feed_loss)
        self.stream_weights = stream_weights
        self.stream = None  # the WeightStream, while the weights stream
        self.optimizer: Optional[oc.VirtualOptimizer] = None

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        opt = find_virtual_optimizer(optimizer)
        if opt is None:
            raise ValueError(f"OptStateCallback: the Trainer's optimizer ({type(optimizer).__name__}) is not an "
                             "optstate optimizer; use optim='optstate_adamw' (after `import optstate_hf`), "
                             "optimizer_cls_and_kwargs=optstate_hf.optimizer_cls_and_kwargs(args), or "
                             "optimizers=(optstate_core.wrap(...), None)")
        self.optimizer = opt
        if opt.release_gradients:
            opt.rebind_parameters()  # FSDP2: the Trainer's prepare swapped in the sharded parameters after wrap()
            from .optimizer import route_max_grad_norm
            route_max_grad_norm(args, opt)
        gradient_state = getattr(optimizer, "gradient_state", None)
        if gradient_state is not None:
            opt.bind_step_boundary(lambda: gradient_state.sync_gradients)
        if self.stream is None and self._wants_stream(opt):
            current = opt.weight_stream  # started by the user already, or by an earlier train()
            self.stream = current if current is not None and not current.closed else \
                oc.stream_weights(kwargs["model"], opt)
        if self.log_metrics and not _run_first(self):
            log.warning("OptStateCallback could not run ahead of the other callbacks: optimizer metrics reach "
                        "trainer.state.log_history but not report_to integrations")

    def _wants_stream(self, opt: oc.VirtualOptimizer) -> bool:
        """Whether to stream: as this callback says, else as the optimizer was wrapped (``stream_weights``)."""
        if self.stream_weights is False and opt.options.stream_weights:
            raise ValueError("OptStateCallback(stream_weights=False), but the optimizer was wrapped with "
                             "stream_weights=True (a _stream optim name, a -stream preset or optim_args "
                             "stream_weights=true) and cannot step unstreamed; drop one of them")
        return bool(self.stream_weights or opt.options.stream_weights)

    def on_log(self, args, state, control, logs=None, **kwargs):
        opt = self.optimizer
        if opt is None or not logs or "loss" not in logs:
            return
        if self.feed_loss and opt.policy.wants_loss:
            opt.observe_loss(logs["loss"])
        metrics = opt.log_metrics(self.prefix) if self.log_metrics else {}
        if opt.release_gradients and opt.last_grad_norm is not None:
            # the Trainer's norm after backward saw only released (freed) gradients (0), or, on
            # transformers 4.x, is not logged once its own clipping is off: the optimizer's norm
            metrics["grad_norm"] = float(opt.last_grad_norm)
        if metrics:
            logs.update(metrics)
            # The Trainer appended a copy of these logs to log_history just before on_log.
            entry = state.log_history[-1] if state.log_history else None
            if entry is not None and entry.get("step") == state.global_step and entry.get("loss") == logs["loss"]:
                entry.update(metrics)

    def on_train_end(self, args, state, control, **kwargs):
        if self.optimizer is not None:
            self.optimizer.bind_step_boundary(None)
        self.optimizer = None
