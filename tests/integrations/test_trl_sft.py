"""TRL's SFTTrainer with LoRA and optim="optstate_adamw...": adapter-only state, exact resume (CPU, no hub)."""
import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("datasets")

import optstate_hf  # noqa: E402
from finetune_testlib import (assert_state_dicts_equal, lora_config, text_rows, tiny_llama,  # noqa: E402
                              tiny_tokenizer, trainable)
from hf_testlib import one_thread  # noqa: E402,F401

pytestmark = pytest.mark.usefixtures("one_thread")


def sft_trainer(out_dir, **overrides):
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    tok = tiny_tokenizer()
    model = tiny_llama(tok)
    kwargs = dict(output_dir=str(out_dir), use_cpu=True, per_device_train_batch_size=8, max_steps=6,
                  learning_rate=1e-2, weight_decay=0.0, lr_scheduler_type="cosine", warmup_steps=1, logging_steps=1,
                  save_strategy="no", report_to=[], disable_tqdm=True, seed=0, max_grad_norm=1.0,
                  optim="optstate_adamw_4bit", optim_args="min_int8_elements=0", dataloader_num_workers=0,
                  dataset_text_field="text")
    kwargs.update(overrides)
    torch.manual_seed(1)  # LoRA's A matrices are drawn inside SFTTrainer
    return SFTTrainer(model=model, args=SFTConfig(**kwargs), train_dataset=Dataset.from_dict({"text": text_rows()}),
                      processing_class=tok, peft_config=lora_config(),
                      callbacks=[optstate_hf.OptStateCallback()])


def test_sft_with_lora_keeps_4bit_state_of_the_adapters_only(tmp_path):
    trainer = sft_trainer(tmp_path, gradient_accumulation_steps=2)
    assert isinstance(trainer.args.optim, str) and trainer.args.optim == "optstate_adamw_4bit"
    trainer.train()
    opt = optstate_hf.find_virtual_optimizer(trainer.optimizer)
    assert opt is not None and opt.step_count == 6
    report = opt.memory_report()
    adapters = [p for n, p in trainer.model.named_parameters() if p.requires_grad and "lora_" in n]
    assert adapters and len(adapters) == sum(p.requires_grad for p in trainer.model.parameters())
    n_adapter = sum(p.numel() for p in adapters)
    assert report["n_params"] == n_adapter
    assert set(report["by_codec"]) == {"int4"}
    # two moments at half a byte per element, plus block scales (rows of 8 elements in LoRA's B)
    assert n_adapter <= report["state_bytes"] <= 1.5 * n_adapter
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 6 and losses[-1] < losses[0]
    assert any("optstate/bits_per_param" in h for h in trainer.state.log_history)


def test_sft_resume_is_bit_identical(tmp_path):
    full = sft_trainer(tmp_path / "full", save_strategy="steps", save_steps=3)
    full.train()
    resumed = sft_trainer(tmp_path / "resumed", save_strategy="steps", save_steps=3)
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-3"))
    a, b = trainable(full.model), trainable(resumed.model)
    assert a.keys() == b.keys() and a
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert_state_dicts_equal(optstate_hf.find_virtual_optimizer(full.optimizer).state_dict(),
                             optstate_hf.find_virtual_optimizer(resumed.optimizer).state_dict())
