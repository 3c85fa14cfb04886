"""optstate for RL post-training frameworks (docs/rl.md).

- :class:`AdamW`: ``torch.optim.AdamW`` with its state compressed (a ``VirtualOptimizer``), built
  the way these frameworks build an optimizer from their config, by dotted path: verl
  (``optim.optimizer_impl: optstate_rl``, ``optim.optimizer: AdamW``), NeMo-RL
  (``policy.optimizer.name: optstate_rl.AdamW``). It pins the host buffers of the phase switch
  ahead (``prepare_park()``) and routes the frameworks' optimizer offload helpers to it.
- :func:`install_hooks`: that routing on its own: verl's ``offload_fsdp_optimizer`` /
  ``load_fsdp_optimizer`` and NeMo-RL's ``move_optimizer_to_device`` call ``offload()`` /
  ``reload()`` for an optstate optimizer (and do what they did for any other).
"""
from .adamw import AdamW
from .hooks import install_hooks, virtual_optimizer

__all__ = ["AdamW", "install_hooks", "virtual_optimizer"]
