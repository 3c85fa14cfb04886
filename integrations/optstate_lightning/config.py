"""What the callback and the strategies share: the user's settings and how one optimizer is wrapped."""
from __future__ import annotations

import copy
from typing import Optional, Union

import torch

import optstate_core as oc
from optstate_core.apps import auto
from optstate_core.presets import with_stream

PolicySpec = Union[None, str, oc.Policy]
AUTO = "auto"


class OptStateConfig:
    """Validated settings: the policy (template), metric logging, and ``oc.wrap`` options.

    ``policy`` is ``None`` (the default preset), a preset name from ``optstate_core.PRESETS`` (or
    one + ``-stream``: the wrap option ``stream_weights=True``),
    ``"auto"`` (preset, ``gpu_budget`` and release planned for the LightningModule when the optimizer
    is wrapped: ``optstate_core.apps.auto.wrap``, whose ``micro_batch``, ``seq_len``, ``loss``,
    ``gpu_memory``, ``activations`` and ``device`` are taken among the wrap options), or an
    ``optstate_core.Policy``. A Policy instance is a *template*: every wrapped optimizer
    gets its own deep copy, so a second ``fit`` or a second optimizer starts from the
    template's phase, and a checkpoint restores the phase it saved.
    """

    def __init__(self, policy: PolicySpec = None, *, log_metrics: bool = True, log_prefix: str = "optstate/",
                 wrap_options: Optional[dict] = None):
        if policy is not None and not isinstance(policy, (str, oc.Policy)):
            raise ValueError(f"policy must be None, a preset name ({', '.join(sorted(oc.PRESETS))}) or an "
                             f"optstate_core.Policy, got {type(policy).__name__}")
        wrap_options = dict(wrap_options or {})
        if isinstance(policy, str):  # "<preset>-stream": the preset, wrapped with stream_weights=True
            policy, wrap_options = with_stream(policy, wrap_options)
        if isinstance(policy, str) and policy != AUTO:
            oc.make_policy(policy)  # raises ValueError naming the valid presets
        if log_metrics not in (True, False):
            raise ValueError(f"log_metrics must be True or False, got {log_metrics!r}")
        if not isinstance(log_prefix, str):
            raise ValueError(f"log_prefix must be a string, got {type(log_prefix).__name__}")
        if "policy" in wrap_options:
            raise ValueError("wrap options: pass the policy as policy=..., not among the wrap options")
        self.auto_options = {k: wrap_options.pop(k) for k in auto.OPTIONS if k in wrap_options} \
            if policy == AUTO else {}
        chosen = [k for k in ("gpu_budget", "offload") if k in wrap_options] if policy == AUTO else []
        if chosen:
            raise ValueError(f"wrap options: {', '.join(chosen)}: policy='auto' chooses it; leave it out or name a "
                             "preset")
        _check_wrap_options(wrap_options)
        self.policy = policy
        self.log_metrics = log_metrics
        self.log_prefix = log_prefix
        self.wrap_options = wrap_options

    def new_policy(self) -> oc.Policy:
        """A fresh policy for one optimizer (never the template object itself)."""
        if self.policy is None:
            return oc.make_policy("default")
        if isinstance(self.policy, str):
            return oc.make_policy(self.policy)
        return copy.deepcopy(self.policy)

    def wrap(self, optimizer: torch.optim.Optimizer, module: Optional[torch.nn.Module]) -> oc.VirtualOptimizer:
        options = dict(self.wrap_options)
        if module is not None and "named_parameters" not in options:
            options["named_parameters"] = list(module.named_parameters())
        if self.policy == AUTO:  # planned for this module on its device now (one log line)
            return auto.wrap(optimizer, module, **self.auto_options, **options)
        return oc.wrap(optimizer, self.new_policy(), **options)

    def describe(self) -> str:
        policy = self.policy if isinstance(self.policy, str) else (
            "default" if self.policy is None else self.policy.describe())
        return f"policy={policy}, options={self.wrap_options}"


def _check_wrap_options(options: dict) -> None:
    """Reject unknown or invalid ``oc.wrap`` options now, not at the first ``fit``."""
    probe = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    try:
        oc.wrap(probe, None, **options)
    except TypeError as e:
        raise ValueError(f"wrap options: {e} (valid: the keyword arguments of optstate_core.VirtualOptimizer)") \
            from None
