"""optstate for the Hugging Face Trainer.

``optim="optstate_adamw"`` (and ``_8bit``, ``_4bit``, ``_offload``, ...), ``"optstate_lion..."`` and
``"optstate_schedule_free_adamw..."`` are registered with the installed transformers: by the
``.pth`` hook of an installed optstate (``optstate_hf_names``) in any process that imports
transformers, or by ``import optstate_hf`` (import it before building ``HfArgumentParser`` or
unpickling ``training_args.bin`` where the hook is off). A Trainer that creates its optimizer from
one of these names gets an ``OptStateCallback`` (warmup switching, accumulation boundaries, metrics)
unless it has one.
"""
from __future__ import annotations

import logging

from .args import KEYS as OPTIM_ARGS_KEYS
from .args import OptimArgs, parse_optim_args
from .callback import OptStateCallback, find_virtual_optimizer
from .optimizer import OptStateAdamW, OptStateLion, OptStateScheduleFreeAdamW, optimizer_cls_and_kwargs
from .registration import OPTIM_NAMES, RegistrationError, is_registered, register

try:
    register()
except RegistrationError as e:  # a transformers without the hooks: the fallback still works
    logging.getLogger("optstate.hf").warning("%s", e)

__all__ = ["OptStateAdamW", "OptStateLion", "OptStateScheduleFreeAdamW", "OptStateCallback", "OptimArgs", "OPTIM_ARGS_KEYS", "OPTIM_NAMES", "RegistrationError",
           "find_virtual_optimizer", "is_registered", "optimizer_cls_and_kwargs", "parse_optim_args", "register"]
