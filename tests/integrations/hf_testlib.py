"""Tiny causal LM, in-memory data and Trainer helpers for the HF integration tests (CPU, no hub)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from transformers.utils import logging as hf_logging  # noqa: E402

hf_logging.set_verbosity_error()

VOCAB, SEQ = 96, 16


def tiny_model(seed: int = 0, hidden: int = 64):
    """A 2-layer GPT-2 from a config (no dropout, so runs are comparable across batchings)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=2, n_embd=hidden, n_head=2, vocab_size=VOCAB, n_positions=SEQ, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(seed)
    return GPT2LMHeadModel(cfg)


def tiny_dataset(n: int = 64, seed: int = 0):
    """Learnable sequences (a noisy counting pattern) as a list of dicts."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        start = int(torch.randint(0, VOCAB, (1,), generator=g))
        ids = (start + torch.arange(SEQ)) % VOCAB
        noise = torch.rand(SEQ, generator=g) < 0.1
        ids = torch.where(noise, torch.randint(0, VOCAB, (SEQ,), generator=g), ids)
        rows.append({"input_ids": ids, "labels": ids.clone()})
    return rows


def training_args(out_dir, **overrides):
    from transformers import TrainingArguments

    kwargs = dict(output_dir=str(out_dir), use_cpu=True, per_device_train_batch_size=4, max_steps=4,
                  learning_rate=3e-3, weight_decay=0.1, warmup_steps=0, lr_scheduler_type="constant",
                  logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True, seed=0,
                  optim="optstate_adamw", optim_args="min_int8_elements=0", dataloader_num_workers=0)
    kwargs.update(overrides)
    return TrainingArguments(**kwargs)


def make_trainer(out_dir, callbacks=None, model=None, dataset=None, trainer_kwargs=None, **overrides):
    from transformers import Trainer

    import optstate_hf

    if callbacks is None:
        callbacks = [optstate_hf.OptStateCallback()]
    return Trainer(model=model or tiny_model(), args=training_args(out_dir, **overrides),
                   train_dataset=dataset or tiny_dataset(), callbacks=callbacks, **(trainer_kwargs or {}))


def losses(trainer):
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def flat_params(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).float() for p in model.parameters()])


@pytest.fixture(autouse=False)
def one_thread():
    """torch intra-op threads spin badly on a loaded 2-core machine; these tiny runs need one."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
