"""(d) torchtitan's state-creating step (zero gradients, lr 0: ``init_optim_state``, run by the
container's ``state_dict()``/``load_state_dict()`` before the first step) creates the optimizer
state with and without gradient release, and leaves the parameters as they were; and release in
torchtitan's train step: clipping handed to the optimizer, one forward/backward per step."""
import pytest

pytest.importorskip("torchtitan.components.optimizer")  # a real torchtitan, not a folder of that name

import os  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
import titan_lib as tl  # noqa: E402


@pytest.mark.parametrize("preset", ["8bit", "bf16"])
def test_init_step_creates_state_with_and_without_release(preset):
    states = {}
    for release in (False, True):
        model = tl.build_model()
        before = tl.params(model)
        optimizers, _ = tl.build(model, preset, release)
        opt = optimizers.optimizers[0]
        assert opt.release_gradients is release and len(opt.state) == 0
        lrs = [g["lr"] for g in opt.param_groups]  # the scheduler's first warmup value
        flat = optimizers.state_dict()  # what torchtitan's checkpointer calls: runs the init step
        params = list(model.parameters())
        assert all(set(opt.state[p]) == {"step", "exp_avg", "exp_avg_sq"} for p in params)
        assert all(f"state.{name}.exp_avg_sq" in {k.split(".encoded")[0] for k in flat}
                   for name, _ in model.named_parameters())
        assert tl.same(tl.params(model), before)  # lr 0 and zero gradients: nothing moved
        assert all(p.grad is None for p in params) and opt.step_count == 1
        assert [g["lr"] for g in opt.param_groups] == lrs == [tl.LR / 2]  # restored after the lr-0 step
        states[release] = tl.decoded_state(optimizers)
    assert tl.same(states[True], states[False])


def test_release_hands_clipping_to_the_optimizer_and_equals_torchtitans_clipping():
    """Without release torchtitan clips (``training.max_norm``) before ``step()``; with release the
    gradients are gone by then (its clip sees none and reports 0) and the optimizer clips at
    ``optstate_max_grad_norm`` by the exact global norm (the model's gradients fit one batch):
    the same parameters, bit for bit."""
    runs = {}
    for release in (False, True):
        model = tl.build_model()
        optimizers, schedulers = tl.build(model, "8bit", release)
        opt = optimizers.optimizers[0]
        assert opt.max_grad_norm == (tl.MAX_NORM if release else None)
        norms = tl.train(model, optimizers, schedulers, 3)
        runs[release] = tl.params(model), norms, float(opt.last_grad_norm) if release else None
    assert tl.same(runs[True][0], runs[False][0])
    assert runs[True][1] == [0.0, 0.0, 0.0]  # torchtitan's clip_grad_norm_ saw no gradient
    assert min(runs[False][1]) > tl.MAX_NORM  # clipping acted on every step
    assert runs[True][2] == pytest.approx(runs[False][1][-1], rel=1e-6)  # the optimizer's pre-clip norm


def test_release_refuses_a_second_forward_before_step():
    model = tl.build_model()
    optimizers, schedulers = tl.build(model, "8bit", release=True)
    x, y = tl.DATA[0]
    torch.nn.functional.mse_loss(model(x), y).backward()
    with torch.no_grad():
        model(x)  # evaluation without gradients is fine
    with pytest.raises(RuntimeError, match="gradient accumulation or pipeline parallelism"):
        model(x)
    optimizers.step()
    model(x)  # a new step


def test_release_off_has_no_guard_and_no_clipping():
    model = tl.build_model()
    optimizers, _ = tl.build(model, "8bit", release=False)
    x, _ = tl.DATA[0]
    model(x), model(x)  # gradient accumulation is torchtitan's business without release
    assert optimizers.optimizers[0].max_grad_norm is None and not optimizers._guard_handles
