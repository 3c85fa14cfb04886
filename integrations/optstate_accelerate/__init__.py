"""optstate for Hugging Face Accelerate.

An optstate optimizer needs nothing special to be prepared: ``accelerator.prepare(model,
oc.wrap(opt), scheduler)`` makes it an ``AcceleratedOptimizer`` like any torch optimizer, and
its state (policy phase included) rides in ``save_state`` / ``load_state``. This package adds:

- :func:`attach`: one call after ``prepare`` that makes the optimizer follow Accelerate's
  gradient-accumulation state (backward-time prefetch only on micro-batches that end in a
  step) and, optionally, log its metrics through ``accelerator.log``.
- :func:`log_metrics`: log the optimizer's metrics through ``accelerator.log`` now.
- :func:`observe_loss`: feed a rank-consistent (process-averaged) loss to the policy.
- :func:`unwrap_optimizer`: the ``VirtualOptimizer`` inside a prepared optimizer.
"""
from .attach import Attachment, attach
from .metrics import log_metrics, observe_loss
from .prepared import unwrap_optimizer

__all__ = ["attach", "Attachment", "log_metrics", "observe_loss", "unwrap_optimizer"]
