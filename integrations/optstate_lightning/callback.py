"""The callback's behaviour, written once for both Lightning packages.

:func:`optstate_lightning.factory.build` mixes :class:`CallbackLogic` into the ``Callback``
class of ``lightning.pytorch`` or ``pytorch_lightning``. It:

* wraps every optimizer of ``trainer.strategy.optimizers`` in ``on_fit_start`` (optimizers
  exist; checkpointed optimizer state is loaded after this hook), reusing the wrapper when the
  same optimizer object comes back in a later ``fit`` and never wrapping a wrapper;
* tells each wrapper, before each training batch, whether this micro-batch ends in an
  optimizer step (automatic optimization; the last micro-batch of an epoch steps too);
* feeds policies that want the training loss (AdaptiveWarmupPolicy) the mean loss of each
  accumulation window, averaged over all ranks, so every rank switches at the same step;
* logs ``VirtualOptimizer.log_metrics()`` through ``pl_module.log_dict`` after each step;
* with ``release_gradients=True``, hands ``gradient_clip_val`` to the optimizers (norm clipping)
  and turns Lightning's own clipping off (value clipping is refused);
* with ``stream_weights=True`` (a wrap option: it turns release on; a ``"<preset>-stream"`` policy sets
  it, and an optimizer wrapped with it asks for it), streams the module's decoder layers' weights from
  host memory (``optstate_core.stream_weights``; docs/weight-streaming.md) from the start of the fit.
"""
from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional

import torch

import optstate_core as oc

from .config import OptStateConfig, PolicySpec

log = logging.getLogger("optstate.lightning")


class CallbackLogic:
    """Mixed into ``Callback`` by the factory. Class attributes set there:
    ``_lightning_optimizer_cls`` and ``_mock_optimizer_cls`` of the package in use."""

    _lightning_optimizer_cls: type = type(None)
    _mock_optimizer_cls: type = type(None)

    def __init__(self, policy: PolicySpec = None, *, log_metrics: bool = True, log_prefix: str = "optstate/",
                 stream_weights: bool = False, **wrap_options: Any):
        super().__init__()
        if not isinstance(stream_weights, bool):
            raise ValueError(f"stream_weights must be True or False, got {stream_weights!r}")
        if stream_weights:  # a wrap option (it turns release on), as a "-stream" preset sets it
            wrap_options["stream_weights"] = True
        self.config = OptStateConfig(policy, log_metrics=log_metrics, log_prefix=log_prefix,
                                     wrap_options=wrap_options)
        self.stream_weights = bool(self.config.wrap_options.get("stream_weights"))
        self._reset_runtime()

    def _reset_runtime(self) -> None:
        #: the wrapped optimizers of the current (or last) fit, in ``trainer.optimizers`` order
        self.optimizers: List[oc.VirtualOptimizer] = []
        #: per optimizer: the first optimizer step with compression on (None: not yet)
        self.switch_steps: List[Optional[int]] = []
        self._feeds_loss: List[bool] = []
        self._ours: Dict[int, oc.VirtualOptimizer] = {}  # id(inner) -> the wrapper we made for it
        self._steps_seen: List[int] = []
        self._will_step = True
        self._loss_sum: Optional[torch.Tensor] = None
        self._loss_count = 0
        self._warned_no_loss = False
        self.stream = None  # the WeightStream of this fit (stream_weights=True)

    def __getstate__(self):  # picklable for ddp_spawn: the runtime state belongs to one process's fit
        state = dict(self.__dict__)
        for key in ("optimizers", "switch_steps", "_feeds_loss", "_ours", "_steps_seen", "_loss_sum", "stream"):
            state.pop(key, None)
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._reset_runtime()

    # -- wrapping ----------------------------------------------------------------------------
    def wrap_optimizers(self, trainer, pl_module) -> List[oc.VirtualOptimizer]:
        """Replace ``trainer.strategy.optimizers`` by wrapped optimizers (idempotent)."""
        strategy = trainer.strategy
        if type(strategy).__name__.startswith("DeepSpeed"):
            raise ValueError("strategy: DeepSpeed manages its own optimizer state; OptStateCallback cannot wrap it. "
                             "Use strategy='ddp' or 'optstate_ddp'.")
        if any(cls.__name__ == "FSDPStrategy" for cls in type(strategy).__mro__):
            raise ValueError("strategy: FSDPStrategy is FSDP1, which shards flattened parameters, so encoded blocks "
                             "would not follow parameter rows and its optimizer checkpoints expect torch's own state "
                             "layout; use ModelParallelStrategy (FSDP2, fully_shard in configure_model) instead")
        others = [cb for cb in trainer.callbacks if isinstance(cb, CallbackLogic) and cb is not self]
        if others:
            raise ValueError("callbacks: more than one OptStateCallback on one Trainer; keep one")
        previous = self._ours
        self._ours = {}
        wrapped, changed = [], False
        for opt in strategy.optimizers:
            new = self._wrapped(opt, pl_module, previous)
            changed |= new is not opt
            wrapped.append(new)
        if changed:
            strategy.optimizers = wrapped  # also rebuilds the LightningOptimizer shells
        self.optimizers = [o for o in wrapped if isinstance(o, oc.VirtualOptimizer)]
        self._route_clipping(trainer)
        self._feeds_loss = [self._take_over_loss_feed(o) for o in self.optimizers]
        self._steps_seen = [o.step_count for o in self.optimizers]
        self.switch_steps = [None] * len(self.optimizers)
        self._reset_window()
        self._start_stream(pl_module)
        return self.optimizers

    def _start_stream(self, pl_module) -> None:
        """Stream the module's layers when this callback or an optimizer's option says so (once per fit)."""
        wanted = self.stream_weights or any(o.options.stream_weights for o in self.optimizers)
        if self.stream is not None or not wanted:
            return
        if len(self.optimizers) != 1:
            raise ValueError(f"stream_weights=True needs the module's one optimizer, got {len(self.optimizers)}")
        current = self.optimizers[0].weight_stream  # started by the user already
        self.stream = current if current is not None and not current.closed else \
            oc.stream_weights(pl_module, self.optimizers[0])

    def _wrapped(self, opt, pl_module, previous: Dict[int, oc.VirtualOptimizer]):
        if isinstance(opt, oc.VirtualOptimizer):
            if id(opt.optimizer) in previous:
                self._ours[id(opt.optimizer)] = opt
            return opt
        if isinstance(opt, (self._lightning_optimizer_cls, self._mock_optimizer_cls)):
            log.warning("not wrapping %s: only plain torch optimizers are wrapped", type(opt).__name__)
            return opt
        vo = previous.get(id(opt))
        if vo is None or vo.optimizer is not opt:
            vo = self.config.wrap(opt, pl_module)
            log.info("optstate: wrapped %s (%s)", type(opt).__name__, self.config.describe())
        self._ours[id(opt)] = vo
        return vo

    def _route_clipping(self, trainer) -> None:
        """With released gradients Lightning's clipping (before ``optimizer.step``) would see no
        gradient: hand ``gradient_clip_val`` to the optimizers (norm clipping) and turn Lightning's
        off; refuse what cannot be routed (value clipping, another norm already set)."""
        releasing = [o for o in self.optimizers if o.release_gradients]
        clip_val = getattr(trainer, "gradient_clip_val", None)
        if not releasing or not clip_val:
            return
        algorithm = getattr(trainer, "gradient_clip_algorithm", None) or "norm"
        algorithm = str(getattr(algorithm, "value", algorithm)).lower()  # GradClipAlgorithmType or a string
        if algorithm != "norm":
            raise ValueError(f"gradient_clip_algorithm={algorithm!r} cannot be applied with release_gradients=True "
                             "(gradients are applied and freed in backward); use gradient_clip_algorithm='norm', "
                             "which the optimizer applies (clip_mode previous or per_tensor)")
        for check_only in (True, False):  # every optimizer checked before any takes it
            for opt in releasing:
                opt.take_over_clipping(float(clip_val), source="gradient_clip_val", check_only=check_only)
        trainer.gradient_clip_val = None
        log.info("optstate: gradients are released in backward; gradient_clip_val=%s is applied by the optimizer "
                 "and Lightning's own clipping is off", clip_val)

    @staticmethod
    def _take_over_loss_feed(opt: oc.VirtualOptimizer) -> bool:
        """Policies that want the loss get it from this callback (window mean, all ranks), not
        from each rank's closure; returns whether this optimizer's policy wants it."""
        if not opt.policy.wants_loss:
            return False
        opt.observe_closure_loss = False  # the core then leaves the closure's per-rank loss alone
        return True

    # -- Callback hooks ------------------------------------------------------------------------
    def on_fit_start(self, trainer, pl_module) -> None:
        self.wrap_optimizers(trainer, pl_module)

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self._reset_window()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if not self.optimizers or not pl_module.automatic_optimization:
            return  # manual optimization: the user knows (and may call set_step_boundary)
        # Lightning's own decision, made before this batch's training_step; true on the last
        # micro-batch of each accumulation window and on the last batch of an epoch.
        self._will_step = not trainer.fit_loop._should_accumulate()
        for opt in self.optimizers:
            opt.set_step_boundary(self._will_step)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not self.optimizers:
            return
        stepped = [o.step_count != seen for o, seen in zip(self.optimizers, self._steps_seen)]
        if pl_module.automatic_optimization:
            self._add_to_window(outputs, trainer.accumulate_grad_batches)
            window_closed = self._will_step
        else:
            self._add_to_window(outputs, 1)
            window_closed = any(stepped)
        if window_closed:
            self._feed_policies(trainer)
        for i, opt in enumerate(self.optimizers):
            if self.switch_steps[i] is None and opt.policy.active(opt.step_count):
                self.switch_steps[i] = opt.step_count
                log.info("optstate: compression active from optimizer step %d on (optimizer %d)", opt.step_count, i)
        if self.config.log_metrics and any(stepped):
            self._log_metrics(pl_module, stepped)
        self._steps_seen = [o.step_count for o in self.optimizers]

    # -- the loss signal -----------------------------------------------------------------------
    def _wants_loss_now(self) -> bool:
        return any(feeds and not o.policy.active(o.step_count) for o, feeds in zip(self.optimizers, self._feeds_loss))

    def _reset_window(self) -> None:
        self._loss_sum, self._loss_count = None, 0

    def _add_to_window(self, outputs, normalized_by: int) -> None:
        if not self._wants_loss_now():
            return
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if not isinstance(loss, torch.Tensor):
            if not self._warned_no_loss:
                log.warning("optstate: the policy wants the training loss, but training_step returned none; "
                            "return the loss (or {'loss': ...}) or call optimizer.observe_loss() yourself")
                self._warned_no_loss = True
            return
        value = loss.detach().float() * normalized_by  # Lightning divides by accumulate_grad_batches
        self._loss_sum = value if self._loss_sum is None else self._loss_sum + value
        self._loss_count += 1

    def _feed_policies(self, trainer) -> None:
        """Observe the window's mean loss, averaged over ranks (one collective per step, on every
        rank alike: whether a policy still wants the loss is the same on all ranks)."""
        if not self._wants_loss_now():
            self._reset_window()
            return
        if self._loss_sum is None:
            # This rank saw no loss; ranks must still meet in the collective.
            mean = torch.tensor(float("nan"), device=trainer.strategy.root_device)
        else:
            mean = self._loss_sum / self._loss_count
        mean = trainer.strategy.reduce(mean.clone(), reduce_op="mean")
        value = float(mean)
        for opt, feeds in zip(self.optimizers, self._feeds_loss):
            if feeds and not opt.policy.active(opt.step_count):
                opt.observe_loss(value)
        self._reset_window()

    # -- metrics ----------------------------------------------------------------------------------
    def _log_metrics(self, pl_module, stepped: List[bool]) -> None:
        metrics = {}
        several = len(self.optimizers) > 1
        for i, (opt, did_step) in enumerate(zip(self.optimizers, stepped)):
            if did_step:
                prefix = f"{self.config.log_prefix}{i}/" if several else self.config.log_prefix
                metrics.update(opt.log_metrics(prefix=prefix))
        pl_module.log_dict(metrics, on_step=True, on_epoch=False, batch_size=1)
