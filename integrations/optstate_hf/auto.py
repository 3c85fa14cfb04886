"""``optim="optstate_adamw_auto"``: the preset, ``gpu_budget`` and gradient release that ``optstate_core.apps.auto`` picks for the Trainer's model."""
from __future__ import annotations

import logging
from typing import Tuple

from optstate_core.apps import auto

from .args import KEYS, OptimArgs, _error

log = logging.getLogger("optstate.auto")  # the one line, as optstate_core.apps.auto.wrap logs it

#: ``optim_args`` keys whose value the plan picks (or assumes: compressed state from the first step)
CHOSEN = ("state", "momentum", "variance", "offload", "gpu_budget", "warmup_steps", "adaptive")


def resolve(args, model, options: OptimArgs, family: str) -> Tuple[str, OptimArgs]:
    """``(preset, optim_args)`` for ``optim="optstate_adamw_auto"``: the plan for ``model`` at the
    Trainer's ``per_device_train_batch_size``, the sequence length of ``optim_args`` ``seq_len``, else
    the trainer's ``max_length`` (TRL), else the model config's ``max_position_embeddings``; the fused
    loss with ``use_liger_kernel`` or a model with the chunked loss. Gradients are released on a
    capped device unless ``optim_args`` say otherwise, the Trainer accumulates gradients (they stay
    until the window's last micro-batch) or uses fp16's GradScaler, and always with ``stream_weights``.
    Logs one line."""
    if family != "adamw":
        raise ValueError(f"optim: the auto preset exists for AdamW only (optstate_adamw_auto), not {family}")
    if model is None:
        raise ValueError("model: optim='optstate_adamw_auto' plans from the model being trained; the Trainer "
                         "passes it (get_optimizer_cls_and_kwargs(args, model)), optstate_hf.optimizer_cls_and_kwargs "
                         "takes it as model=")
    clash = [k for k in CHOSEN if k in options]
    if clash:
        raise _error(f"{', '.join(clash)}: chosen by optim='optstate_adamw_auto' (compressed state from the first "
                     "step, where the plan puts it); leave it out or name a preset")
    release, context = options.get("release_gradients"), []
    if release is None and options.get("stream_weights"):
        release = True  # streamed weights are updated in backward
        context.append("release: stream_weights")
    elif release is None and args.gradient_accumulation_steps > 1:
        release = False
        context.append(f"no release: gradient_accumulation_steps={args.gradient_accumulation_steps} keeps gradients")
    elif release is None and getattr(args, "fp16", False):
        release = False
        context.append("no release: fp16's GradScaler unscales in step()")
    seq_len = options.get("seq_len")
    for key in ("max_length", "max_seq_length") if seq_len is None else ():
        if isinstance(getattr(args, key, None), int):
            seq_len = getattr(args, key)
            context.append(f"sequence length from the trainer's {key}")
            break
    loss = options.get("loss") or ("liger" if getattr(args, "use_liger_kernel", False) else None)
    choice = auto.choose(model, micro_batch=args.per_device_train_batch_size, seq_len=seq_len, loss=loss,
                         gpu_memory=options.get("gpu_memory"), activations=options.get("activations"),
                         release_gradients=release, checkpointing=bool(args.gradient_checkpointing) or None,
                         release_bucket_bytes=options.get("release_bucket_bytes"), context=context)
    log.info("%s", choice.describe())
    values = {k: v for k, v in options.as_dict().items() if KEYS[k].target != "auto"}
    return choice.preset, OptimArgs({**values, **choice.wrap_options()})
