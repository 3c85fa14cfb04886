"""optim="optstate_adamw_auto": the Trainer's model planned when the optimizer is created (CPU: no cap),
optim_args that steer or clash with the plan, liger's loss planned as the fused one, and bad inputs."""
import logging

import pytest
import torch

pytest.importorskip("transformers")

import optstate_core as oc  # noqa: E402
import optstate_hf  # noqa: E402
from hf_testlib import one_thread, training_args  # noqa: E402,F401
from optstate_core.apps import auto  # noqa: E402
from optstate_core.apps.model_shapes import checkpointed_activation_bytes  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, Trainer  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

CONFIG = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=2, max_position_embeddings=16)


def tiny_llama(dtype=torch.float32):
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**CONFIG)).to(dtype)


def rows(n=8, seq=16):
    ids = torch.randint(0, 64, (n, seq), generator=torch.Generator().manual_seed(0))
    return [{"input_ids": r, "labels": r.clone()} for r in ids]


def train_one_step(tmp_path, model, **overrides):
    args = training_args(tmp_path, optim="optstate_adamw_auto", max_steps=1, per_device_train_batch_size=2,
                         **{"optim_args": None, **overrides})
    trainer = Trainer(model=model, args=args, train_dataset=rows())
    trainer.train()
    return trainer, oc.unwrap(trainer.optimizer)


def test_auto_name_trains_a_tiny_llama_and_logs_its_choice(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="optstate"):
        trainer, opt = train_one_step(tmp_path, tiny_llama())
    assert opt.step_count == 1 and not opt.release_gradients
    assert opt.policy.describe() == oc.make_policy("8bit").describe()  # the CPU: no cap, the first candidate
    lines = [r.getMessage() for r in caplog.records if r.name == "optstate.auto"]
    assert len(lines) == 1 and lines[0].startswith("optstate auto: 8bit, release_gradients=False")
    assert "micro-batch 2 x 16 tokens" in lines[0] and "config.max_position_embeddings" in lines[0]
    assert any(type(c).__name__ == "OptStateCallback" for c in trainer.callback_handler.callbacks)


def test_bf16_model_under_a_cap_releases_with_the_trainers_clipping(tmp_path):
    trainer, opt = train_one_step(tmp_path, tiny_llama(torch.bfloat16), optim_args="gpu_memory=1GB,seq_len=16",
                                  max_grad_norm=0.5)
    assert opt.policy.describe() == oc.make_policy("bf16w-4bit-lean").describe()
    assert opt.release_gradients and opt.max_grad_norm == 0.5 and trainer.args.max_grad_norm == 0.0
    assert opt.step_count == 1


def test_accumulation_keeps_the_gradients_so_auto_does_not_release(tmp_path):
    args = training_args(tmp_path, optim="optstate_adamw_auto", optim_args="gpu_memory=1GB",
                         gradient_accumulation_steps=2, per_device_train_batch_size=2)
    cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args, tiny_llama())
    assert kwargs["preset"] == "8bit" and kwargs["optim_args"].get("release_gradients") is False
    assert "max_grad_norm" not in kwargs


def test_liger_is_planned_as_the_fused_loss(tmp_path, caplog):
    """use_liger_kernel=True: the planner's no-logits estimate (liger's kernels need CUDA, so only the plan
    is checked here; the run itself is for the GPU suite)."""
    args = training_args(tmp_path, optim="optstate_adamw_auto", optim_args="gpu_memory=1GB,seq_len=16",
                         use_liger_kernel=True, per_device_train_batch_size=2)
    model = tiny_llama()
    with caplog.at_level(logging.INFO, logger="optstate.auto"):
        Trainer.get_optimizer_cls_and_kwargs(args, model)
    line = next(r.getMessage() for r in caplog.records if r.name == "optstate.auto")
    fused = checkpointed_activation_bytes(model.config.to_dict(), 2, 16, fused_loss=True)
    assert "loss liger (no logits)" in line
    assert auto.choose(model, gpu_memory="1GB", micro_batch=2, seq_len=16, loss="liger").activations == fused


@pytest.mark.parametrize("optim_args, match", [
    ("state=int4", "state: chosen by optim='optstate_adamw_auto'"),
    ("gpu_budget=1GB", "gpu_budget: chosen by"),
    ("warmup_steps=10", "warmup_steps: chosen by"),
    ("loss=fast", "loss='fast' must be one of plain, fused, chunked, liger"),
    ("seq_len=0", "seq_len='0' must be >= 1"),
    ("gpu_memory=50KB", "model: no preset fits"),
])
def test_bad_optim_args_fail_at_creation_and_leave_no_optimizer(tmp_path, optim_args, match):
    args = training_args(tmp_path, optim="optstate_adamw_auto", optim_args=optim_args)
    trainer = Trainer(model=tiny_llama(), args=args, train_dataset=rows())
    with pytest.raises(ValueError, match=match):
        trainer.create_optimizer()
    assert trainer.optimizer is None


def test_auto_needs_the_model_and_its_keys_need_auto(tmp_path):
    args = training_args(tmp_path, optim="optstate_adamw_auto")
    with pytest.raises(ValueError, match="model: optim='optstate_adamw_auto' plans from the model"):
        Trainer.get_optimizer_cls_and_kwargs(args)
    with pytest.raises(ValueError, match="model:"):
        optstate_hf.optimizer_cls_and_kwargs(args, preset="auto")
    cls, kwargs = optstate_hf.optimizer_cls_and_kwargs(args, preset="auto", model=tiny_llama())
    assert cls is optstate_hf.OptStateAdamW and kwargs["preset"] == "8bit"
    with pytest.raises(ValueError, match="seq_len only apply with optim='optstate_adamw_auto'"):
        Trainer.get_optimizer_cls_and_kwargs(training_args(tmp_path, optim="optstate_adamw_8bit",
                                                           optim_args="seq_len=128"), tiny_llama())
