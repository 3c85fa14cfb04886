"""PEFT LoRA through the HF Trainer: only adapter state, exact resume (tiny Llama, CPU, no hub)."""
import pytest
import torch

pytest.importorskip("peft")

import optstate_hf  # noqa: E402
from finetune_testlib import (assert_state_dicts_equal, lora_config, text_rows, tiny_llama,  # noqa: E402
                              tiny_tokenizer, trainable)
from hf_testlib import one_thread  # noqa: E402,F401

pytestmark = pytest.mark.usefixtures("one_thread")


def lora_trainer(out_dir, **overrides):
    from peft import get_peft_model
    from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments

    tok = tiny_tokenizer()
    model = tiny_llama(tok)
    torch.manual_seed(1)  # LoRA's A matrices are drawn here
    model = get_peft_model(model, lora_config())
    rows = [{"input_ids": ids} for ids in tok(text_rows())["input_ids"]]
    kwargs = dict(output_dir=str(out_dir), use_cpu=True, per_device_train_batch_size=8, max_steps=6,
                  learning_rate=1e-2, weight_decay=0.0, lr_scheduler_type="cosine", warmup_steps=1, logging_steps=1,
                  save_strategy="no", report_to=[], disable_tqdm=True, seed=0, max_grad_norm=1.0,
                  optim="optstate_adamw_8bit", optim_args="min_int8_elements=0", dataloader_num_workers=0)
    kwargs.update(overrides)
    return Trainer(model=model, args=TrainingArguments(**kwargs), train_dataset=rows,
                   data_collator=DataCollatorForLanguageModeling(tok, mlm=False),
                   callbacks=[optstate_hf.OptStateCallback()])


def test_lora_state_covers_only_the_adapters(tmp_path):
    trainer = lora_trainer(tmp_path, gradient_accumulation_steps=2)
    frozen = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if not p.requires_grad}
    before = trainable(trainer.model)
    trainer.train()
    opt = optstate_hf.find_virtual_optimizer(trainer.optimizer)
    report = opt.memory_report()
    adapters = {n: p for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert adapters and all("lora_" in n for n in adapters)
    n_adapter = sum(p.numel() for p in adapters.values())
    assert report["n_params"] == n_adapter < sum(p.numel() for p in frozen.values()) / 10
    # int8 payloads (1 byte per element) plus block scales (LoRA's B has rows of 8 elements, so
    # 2.5 bytes per element in all), for both moments of each adapter and nothing else
    assert set(report["by_codec"]) == {"int8"}
    assert 2 * n_adapter <= report["state_bytes"] <= 2.5 * n_adapter
    state = opt.state_dict()["state"]
    assert len(state) == len(adapters)
    assert report["step"] == 6 and report["compression_active"]
    for n, p in trainer.model.named_parameters():
        if p.requires_grad:
            assert not torch.equal(p, before[n]), n
        else:
            assert torch.equal(p, frozen[n]), n
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert losses[-1] < losses[0]


def test_lora_resume_is_bit_identical(tmp_path):
    full = lora_trainer(tmp_path / "full", save_strategy="steps", save_steps=3)
    full.train()
    checkpoint = tmp_path / "full" / "checkpoint-3"
    assert (checkpoint / "adapter_model.safetensors").exists() and (checkpoint / "optimizer.pt").exists()
    resumed = lora_trainer(tmp_path / "resumed", save_strategy="steps", save_steps=3)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    a, b = trainable(full.model), trainable(resumed.model)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    opt_full = optstate_hf.find_virtual_optimizer(full.optimizer)
    opt_resumed = optstate_hf.find_virtual_optimizer(resumed.optimizer)
    assert opt_resumed.step_count == opt_full.step_count == 6
    assert_state_dicts_equal(opt_full.state_dict(), opt_resumed.state_dict())
