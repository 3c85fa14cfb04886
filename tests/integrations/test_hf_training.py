"""Training through the HF Trainer: exactness vs adamw_torch, accumulation, resume, mixed precision."""
import os

import pytest
import torch

pytest.importorskip("transformers")

import optstate_core as oc  # noqa: E402
import optstate_hf  # noqa: E402
from hf_testlib import flat_params, losses, make_trainer, one_thread, tiny_model  # noqa: E402,F401

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("accumulation", [1, 4])
def test_fp32_codec_equals_adamw_torch_exactly(tmp_path, accumulation):
    runs = {}
    for optim, optim_args in (("adamw_torch", None), ("optstate_adamw", "state=fp32")):
        trainer = make_trainer(tmp_path / optim, optim=optim, optim_args=optim_args, max_steps=4,
                               per_device_train_batch_size=8 // accumulation,
                               gradient_accumulation_steps=accumulation, max_grad_norm=1.0,
                               callbacks=[] if optim == "adamw_torch" else None)
        trainer.train()
        runs[optim] = (losses(trainer), flat_params(trainer.model))
    assert runs["optstate_adamw"][0] == runs["adamw_torch"][0]
    assert torch.equal(runs["optstate_adamw"][1], runs["adamw_torch"][1])


def test_accumulation_matches_large_batch(tmp_path):
    runs = {}
    for accumulation in (1, 4):
        trainer = make_trainer(tmp_path / str(accumulation), max_steps=5, per_device_train_batch_size=8 // accumulation,
                               gradient_accumulation_steps=accumulation, learning_rate=1e-3)
        trainer.train()
        runs[accumulation] = (losses(trainer), flat_params(trainer.model))
        assert optstate_hf.find_virtual_optimizer(trainer.optimizer).step_count == 5
    start = flat_params(tiny_model())
    moved = (runs[1][1] - start).abs().max()
    assert moved > 1e-3
    # The same gradients up to float summation order; int8 rounding may land a near-tie element on
    # the neighbouring code, so allow a few elements to differ by a fraction of an lr step.
    diff = (runs[4][1] - runs[1][1]).abs()
    assert float(diff.max()) < 0.05 * float(moved)
    assert float((diff > 1e-6).float().mean()) < 1e-3
    assert runs[4][0] == pytest.approx(runs[1][0], rel=1e-5)


def test_resume_continues_exactly(tmp_path):
    # The adaptive policy switches (3rd log) before the checkpoint at step 4, long before
    # warmup_steps=100: the resumed run must continue in the compressed phase, from the same state.
    common = dict(max_steps=8, save_strategy="steps", save_steps=4,
                  optim_args="min_int8_elements=0,warmup_steps=100,adaptive=true,patience=2,tol=0.5")
    full = make_trainer(tmp_path / "full", **common)
    full.train()
    full_losses = losses(full)

    checkpoint = tmp_path / "full" / "checkpoint-4"
    saved = torch.load(os.path.join(checkpoint, "optimizer.pt"), weights_only=True)
    assert saved["optstate"]["policy"]["switched"] is True and saved["optstate"]["step"] == 4
    assert any(isinstance(v, dict) and "encoded" in v for st in saved["state"].values() for v in st.values())

    resumed = make_trainer(tmp_path / "resumed", **common)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    opt = optstate_hf.find_virtual_optimizer(resumed.optimizer)
    assert opt.policy.switched and opt.step_count == 8
    after = [h for h in resumed.state.log_history if "loss" in h and h["step"] > 4]  # the rest came with the checkpoint
    assert [h["loss"] for h in after] == full_losses[4:]
    assert torch.equal(flat_params(resumed.model), flat_params(full.model))
    assert [h["optstate/compression_active"] for h in after] == [1.0] * 4


def test_bf16_autocast_trains(tmp_path):
    runs = {}
    for optim in ("adamw_torch", "optstate_adamw"):
        trainer = make_trainer(tmp_path / optim, optim=optim, bf16=True, max_steps=12,
                               optim_args=None if optim == "adamw_torch" else "min_int8_elements=0",
                               callbacks=[] if optim == "adamw_torch" else None)
        dtypes = []
        trainer.model.transformer.h[0].mlp.c_fc.register_forward_hook(lambda m, i, o: dtypes.append(o.dtype))
        trainer.train()
        assert dtypes[0] == torch.bfloat16
        runs[optim] = losses(trainer)
    ours, ref = runs["optstate_adamw"], runs["adamw_torch"]
    assert all(torch.isfinite(torch.tensor(ours)))
    assert sum(ours[-3:]) < sum(ours[:3]) - 0.3  # it learns
    assert ours == pytest.approx(ref, abs=0.05)


class CountingScaler(torch.amp.GradScaler):
    """A CPU GradScaler that counts how often gradients are unscaled."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.unscale_calls = 0

    def unscale_(self, optimizer):
        self.unscale_calls += 1
        return super().unscale_(optimizer)


def fp16_run(out_dir, optim, optim_args, max_grad_norm, init_scale=2.0**12):
    """fp16 with a GradScaler, as on GPU. On CPU Accelerate turns fp16 off (no autocast, no
    scaler), so switch its native AMP on with a CPU GradScaler before train()."""
    trainer = make_trainer(out_dir, optim=optim, optim_args=optim_args, fp16=True, max_steps=4,
                           max_grad_norm=max_grad_norm, callbacks=[] if optim == "adamw_torch" else None)
    assert trainer.accelerator.mixed_precision == "fp16"
    trainer.accelerator.native_amp = True
    trainer.accelerator.scaler = CountingScaler("cpu", init_scale=init_scale)
    grad_norms, dtypes = [], []
    trainer.model.transformer.h[0].mlp.c_fc.register_forward_hook(lambda m, i, o: dtypes.append(o.dtype))
    trainer.create_optimizer()
    inner = optstate_hf.find_virtual_optimizer(trainer.optimizer) or trainer.optimizer
    inner.register_step_pre_hook(lambda opt, args, kwargs: grad_norms.append(
        float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for g in opt.param_groups for p in g["params"]])))))
    trainer.train()
    assert dtypes[0] == torch.float16
    return trainer, grad_norms


@pytest.mark.parametrize("max_grad_norm", [0.0, 1.0])
def test_fp16_grad_scaler_unscales_exactly_once(tmp_path, max_grad_norm):
    ref, ref_norms = fp16_run(tmp_path / "ref", "adamw_torch", None, max_grad_norm)
    ours, our_norms = fp16_run(tmp_path / "ours", "optstate_adamw", "state=fp32", max_grad_norm)
    scaler = ours.accelerator.scaler
    assert scaler.get_scale() == 2.0**12  # no overflow: every step ran
    assert scaler.unscale_calls == ref.accelerator.scaler.unscale_calls == 4
    assert optstate_hf.find_virtual_optimizer(ours.optimizer).step_count == 4
    # the optimizer saw unscaled gradients (scaled ones would be 4096x larger) ...
    assert our_norms == ref_norms and max(our_norms) < 50
    # ... and updated exactly like torch's AdamW under the same scaler
    assert losses(ours) == losses(ref)
    assert torch.equal(flat_params(ours.model), flat_params(ref.model))


def test_fp16_grad_scaler_with_int8_state_learns(tmp_path):
    trainer, norms = fp16_run(tmp_path, "optstate_adamw", "min_int8_elements=0", 1.0)
    opt = optstate_hf.find_virtual_optimizer(trainer.optimizer)
    # every tensor int8 but the 1-D ones that are not whole 256-blocks
    assert opt.step_count == 4 and set(opt.memory_report()["by_codec"]) == {"int8", "fp32"}
    assert trainer.accelerator.scaler.unscale_calls == 4
    assert losses(trainer)[-1] < losses(trainer)[0] and max(norms) < 50
    assert isinstance(opt, oc.VirtualOptimizer) and not hasattr(opt, "_step_supports_amp_scaling")


def test_fp16_overflowing_steps_are_skipped(tmp_path):
    # 2**20 overflows fp16 gradients for three steps (the scale halves each time), then steps.
    ref, _ = fp16_run(tmp_path / "ref", "adamw_torch", None, 1.0, init_scale=2.0**20)
    ours, _ = fp16_run(tmp_path / "ours", "optstate_adamw", "state=fp32", 1.0, init_scale=2.0**20)
    opt = optstate_hf.find_virtual_optimizer(ours.optimizer)
    ref_steps = {int(st["step"]) for st in ref.optimizer.optimizer.state.values()}
    assert ours.accelerator.scaler.get_scale() == 2.0**17
    assert opt.step_count == 1 and ref_steps == {1}
    assert opt.state_dict()["optstate"]["nonfinite_skipped"] == 0  # the scaler skipped, not the optimizer
    assert torch.equal(flat_params(ours.model), flat_params(ref.model))
