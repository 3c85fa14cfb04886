"""A wrapped schedule-free optimizer through the HF Trainer, Lightning and Accelerate: the frameworks
call its ``train()``/``eval()``; it trains as unwrapped (``fp32`` bit for bit) and resumes bit for bit."""
import os

import pytest
import torch

schedulefree = pytest.importorskip("schedulefree")
pytest.importorskip("transformers")

import optstate_core as oc  # noqa: E402
from hf_testlib import flat_params, losses, make_trainer, one_thread, tiny_dataset, tiny_model  # noqa: E402,F401

pytestmark = pytest.mark.usefixtures("one_thread")


def schedule_free(model, preset):
    inner = schedulefree.AdamWScheduleFree(model.parameters(), lr=3e-3, warmup_steps=2, weight_decay=0.1)
    return inner if preset is None else oc.wrap(inner, preset)


def sf_trainer(out_dir, preset, trainer_kwargs=None, **overrides):
    model = tiny_model()
    callbacks = [] if preset is None else None  # None: the OptStateCallback
    return make_trainer(out_dir, model=model, callbacks=callbacks, **overrides,
                        trainer_kwargs=dict(optimizers=(schedule_free(model, preset), None), **(trainer_kwargs or {})))


def test_hf_trainer_schedule_free_fp32_is_bit_identical_and_the_trainer_switches_modes(tmp_path):
    runs = {}
    for preset in (None, "fp32"):
        trainer = sf_trainer(tmp_path / str(preset), preset, max_steps=5, eval_strategy="steps", eval_steps=5,
                             trainer_kwargs=dict(eval_dataset=tiny_dataset(8, seed=1)))
        trainer.train()
        inner = trainer.optimizer.optimizer if preset is None else trainer.optimizer.optimizer.optimizer
        runs[preset] = (losses(trainer), flat_params(trainer.model), inner.param_groups[0])
    assert runs["fp32"][0] == runs[None][0]
    assert torch.equal(runs["fp32"][1], runs[None][1])
    assert runs["fp32"][2]["k"] == runs[None][2]["k"] == 5
    assert runs["fp32"][2]["train_mode"] is runs[None][2]["train_mode"] is False  # the Trainer's eval() reached it


@pytest.mark.parametrize("preset", ["fp32", "8bit"])
def test_hf_trainer_schedule_free_resumes_bit_for_bit(tmp_path, preset):
    common = dict(max_steps=8, save_strategy="steps", save_steps=4)
    full = sf_trainer(tmp_path / "full", preset, **common)
    full.train()
    checkpoint = tmp_path / "full" / "checkpoint-4"
    saved = torch.load(os.path.join(checkpoint, "optimizer.pt"), weights_only=True)
    assert saved["param_groups"][0]["k"] == 4
    resumed = sf_trainer(tmp_path / "resumed", preset, **common)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    after = [h["loss"] for h in resumed.state.log_history if "loss" in h and h["step"] > 4]
    assert after == losses(full)[4:]
    assert torch.equal(flat_params(resumed.model), flat_params(full.model))


def test_accelerate_prepare_forwards_train_and_eval(tmp_path):
    from accelerate import Accelerator

    model = tiny_model()
    opt = schedule_free(model, "8bit")
    accelerator = Accelerator(cpu=True)
    model, prepared = accelerator.prepare(model, opt)
    inner = opt.optimizer
    prepared.train()
    assert inner.param_groups[0]["train_mode"] is True
    ids = torch.randint(0, 96, (4, 16))
    for _ in range(3):
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        prepared.step()
        prepared.zero_grad()
    before = flat_params(model)
    prepared.eval()  # x from y and z: the parameters move, z (lossless) is read from the store
    assert inner.param_groups[0]["train_mode"] is False
    assert not torch.equal(before, flat_params(model))
    prepared.train()
    assert torch.allclose(before, flat_params(model), atol=1e-6)  # and back to y


@pytest.mark.parametrize("preset", ["fp32", "8bit"])
def test_lightning_schedule_free_trains_and_resumes_bit_for_bit(tmp_path, preset):
    """OptStateCallback wraps the schedule-free optimizer configure_optimizers returns; the module
    switches it to train mode each epoch. fp32 equals the unwrapped run; a ModelCheckpoint resume
    at epoch 2 equals the uninterrupted run to epoch 4."""
    pytest.importorskip("lightning")
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning_helpers import Regressor, loader, trainer
    from optstate_lightning import OptStateCallback

    class ScheduleFreeRegressor(Regressor):
        def configure_optimizers(self):
            return schedulefree.AdamWScheduleFree(self.parameters(), lr=self.lr, warmup_steps=2)

        def on_train_epoch_start(self):
            self.optimizers().train()

    def fit(model, epochs, wrapped=True, ckpt_path=None, **kw):
        callbacks = [OptStateCallback(policy=preset)] if wrapped else []
        trainer(callbacks=callbacks + kw.pop("callbacks", []), max_epochs=epochs, **kw).fit(
            model, loader(), ckpt_path=ckpt_path)
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    full = ScheduleFreeRegressor(lr=1e-2)
    full_params = fit(full, 4)
    if preset == "fp32":
        assert torch.equal(full_params, fit(ScheduleFreeRegressor(lr=1e-2), 4, wrapped=False))
    first = ScheduleFreeRegressor(lr=1e-2)
    fit(first, 2, callbacks=[ModelCheckpoint(dirpath=tmp_path, save_last=True, save_top_k=0)],
        enable_checkpointing=True)
    resumed = ScheduleFreeRegressor(seed=123, lr=1e-2)
    resumed_params = fit(resumed, 4, ckpt_path=str(tmp_path / "last.ckpt"))
    assert resumed.losses == full.losses[16:]
    assert torch.equal(resumed_params, full_params)


def test_hf_optim_names_for_schedule_free_and_lion_match_the_unwrapped_optimizers(tmp_path):
    """``optim="optstate_schedule_free_adamw"`` with ``state=fp32`` equals the Trainer's own
    ``schedule_free_adamw`` bit for bit; ``optstate_lion`` equals lion-pytorch's Lion handed to the
    Trainer; the 8-bit names train."""
    import optstate_hf
    lion_pytorch = pytest.importorskip("lion_pytorch")
    common = dict(max_steps=4, warmup_steps=2, lr_scheduler_type="constant", learning_rate=1e-3)
    own = make_trainer(tmp_path / "own", callbacks=[], optim="schedule_free_adamw", optim_args=None, **common)
    own.train()
    ours = make_trainer(tmp_path / "ours", optim="optstate_schedule_free_adamw", optim_args="state=fp32", **common)
    ours.train()
    assert isinstance(optstate_hf.find_virtual_optimizer(ours.optimizer), optstate_hf.OptStateScheduleFreeAdamW)
    assert losses(ours) == losses(own)
    assert torch.equal(flat_params(ours.model), flat_params(own.model))

    model = tiny_model()
    lion = lion_pytorch.Lion(model.parameters(), lr=1e-3, betas=(0.9, 0.999))  # no decay: the Trainer's groups differ
    plain = make_trainer(tmp_path / "lion", callbacks=[], model=model, trainer_kwargs=dict(optimizers=(lion, None)),
                         weight_decay=0.0, **common)
    plain.train()
    named = make_trainer(tmp_path / "optstate_lion", optim="optstate_lion", optim_args="state=fp32", weight_decay=0.0,
                         **common)
    named.train()
    assert torch.equal(flat_params(named.model), flat_params(plain.model))
    # uncompressed: Lion 32 bits/param (one moment), schedule-free 64 (z and v); z stays fp32 (an iterate)
    for name, most_bits in (("optstate_lion_8bit", 12), ("optstate_schedule_free_adamw_4bit", 40)):
        trainer = make_trainer(tmp_path / name, optim=name, optim_args=None, **dict(common, max_steps=6))
        trainer.train()
        assert losses(trainer)[-1] < losses(trainer)[0]
        assert optstate_hf.find_virtual_optimizer(trainer.optimizer).memory_report()["bits_per_param"] < most_bits


def test_accelerate_save_state_and_load_state_resume_schedule_free_bit_for_bit(tmp_path):
    """prepare(wrap(AdamWScheduleFree)) with int8 state: save_state after 3 steps (in eval mode, as
    before a checkpoint), load_state into a fresh model and optimizer, train 3 more: the same
    parameters as 6 uninterrupted steps."""
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    ids = [torch.randint(0, 96, (4, 16), generator=torch.Generator().manual_seed(i)) for i in range(6)]

    def steps(model, prepared, accelerator, batches):
        prepared.train()
        for b in batches:
            accelerator.backward(model(input_ids=b, labels=b).loss)
            prepared.step()
            prepared.zero_grad()

    set_seed(0)
    full_model = tiny_model()
    accelerator = Accelerator(cpu=True)
    model, opt = accelerator.prepare(full_model, schedule_free(full_model, "8bit"))
    steps(model, opt, accelerator, ids[:3])
    opt.eval()  # what the interrupted run does before saving (x -> y again is not exact in fp32)
    steps(model, opt, accelerator, ids[3:])
    full = flat_params(model)

    first_model = tiny_model()
    accelerator = Accelerator(cpu=True)
    model, opt = accelerator.prepare(first_model, schedule_free(first_model, "8bit"))
    steps(model, opt, accelerator, ids[:3])
    opt.eval()
    accelerator.save_state(str(tmp_path / "ckpt"))

    resumed_model = tiny_model(seed=7)
    accelerator = Accelerator(cpu=True)
    model, opt = accelerator.prepare(resumed_model, schedule_free(resumed_model, "8bit"))
    accelerator.load_state(str(tmp_path / "ckpt"))
    assert opt.optimizer.optimizer.param_groups[0]["k"] == 3
    steps(model, opt, accelerator, ids[3:])
    assert torch.equal(flat_params(model), full)
