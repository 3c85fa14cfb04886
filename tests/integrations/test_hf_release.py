"""HF Trainer with gradient release: the Trainer's max_grad_norm is routed to the optimizer."""
import pytest
import torch

from hf_testlib import flat_params, make_trainer, one_thread, tiny_model  # noqa: F401

import optstate_core as oc
import optstate_hf
from transformers import TrainerCallback


class GradsAtStep(TrainerCallback):
    """Records, before each optimizer step, how many parameters still hold a gradient."""

    def __init__(self):
        self.alive = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.alive.append(sum(p.grad is not None for p in model.parameters()))


def _train(tmp_path, max_grad_norm, optim_args, **overrides):
    spy = GradsAtStep()
    model = tiny_model()
    trainer = make_trainer(tmp_path, callbacks=[optstate_hf.OptStateCallback(), spy], model=model,
                           max_grad_norm=max_grad_norm, optim_args=optim_args, max_steps=3,
                           gradient_accumulation_steps=2, per_device_train_batch_size=2, **overrides)
    trainer.train()
    return trainer, model, spy


def test_trainer_clipping_is_routed_to_the_optimizer(tmp_path, one_thread):
    trainer, model, spy = _train(tmp_path / "a", 1e-3, "release_gradients=true,clip_mode=per_tensor")
    opt = optstate_hf.find_virtual_optimizer(trainer.optimizer)
    assert opt.release_gradients and opt.max_grad_norm == 1e-3 and opt.clip_mode == "per_tensor"
    assert trainer.args.max_grad_norm == 0.0  # the Trainer no longer clips (it would see no gradient)
    assert spy.alive == [0, 0, 0]  # every gradient was applied and freed in backward
    assert opt.step_count == 3 and opt.last_grad_norm is not None and float(opt.last_grad_norm) > 1e-3
    # the logged grad_norm is the optimizer's pre-clip global norm (the Trainer's own saw no gradient: 0)
    logged = [(e["step"], e["grad_norm"]) for e in trainer.state.log_history if "grad_norm" in e]
    assert logged and all(g > 1e-3 for _, g in logged)
    assert logged[-1][0] == 3 and logged[-1][1] == pytest.approx(float(opt.last_grad_norm))
    unclipped, model2, _ = _train(tmp_path / "b", 0.0, "release_gradients=true,clip_mode=per_tensor")
    assert optstate_hf.find_virtual_optimizer(unclipped.optimizer).max_grad_norm is None
    assert not torch.equal(flat_params(model), flat_params(model2))  # the clipping did act


def test_trainer_refuses_two_different_clipping_norms(tmp_path, one_thread):
    model = tiny_model()
    opt = oc.wrap(torch.optim.AdamW(model.parameters(), lr=1e-3), "8bit", release_gradients=True, max_grad_norm=2.0)
    trainer = make_trainer(tmp_path, model=model, max_steps=1, max_grad_norm=1.0,
                           trainer_kwargs={"optimizers": (opt, None)})
    with pytest.raises(ValueError, match="max_grad_norm"):
        trainer.train()
