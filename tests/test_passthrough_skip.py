"""NaN/inf skipping for fp32 state stepped by torch's fused AdamW: on the device, through torch's
own found_inf (no host sync), the whole passthrough call skipped, bit-identical otherwise."""
import pytest
import torch

import optstate_core as oc
from optstate_core.schedule import engine as engine_module
from optstate_core.schedule.engine import Engine
from helpers import batch, flat_params, mlp
from test_invariants import same_state, snapshot

pytestmark = pytest.mark.skipif(not hasattr(torch, "_fused_adamw_"), reason="torch without fused AdamW")


def grads_of(model, seed):
    x, y = batch(seed)
    model.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()


def test_fused_passthrough_is_bit_identical_and_skips_a_nonfinite_step_on_the_device(monkeypatch):
    ref_model, model = mlp(), mlp()
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    opt = oc.wrap(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True), "fp32")
    # the device path never asks the host whether gradients are finite
    monkeypatch.setattr(engine_module, "all_finite", lambda *a: pytest.fail("host-side finiteness check"))
    monkeypatch.setattr(Engine, "drop_nonfinite", lambda *a: pytest.fail("host-side finiteness check"))
    for s in range(5):
        grads_of(model, s)
        grads_of(ref_model, s)
        if s == 2:  # the wrapped step sees a NaN: nothing moves; the reference skips the step
            model[0].weight.grad[1, 2] = float("nan")
            before = snapshot(opt, model)
            opt.step()
            after = snapshot(opt, model)
            assert torch.equal(after[0], before[0]) and same_state(after[1], before[1])
            assert opt.memory_report()["nonfinite_skipped"] == len(list(model.parameters()))
            continue
        ref.step()
        opt.step()
        assert torch.equal(flat_params(model), flat_params(ref_model)), s  # bit for bit
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert float(opt.state[p]["step"]) == float(ref.state[q]["step"]) == 4.0
        assert torch.equal(opt.state[p]["exp_avg_sq"], ref.state[q]["exp_avg_sq"])


def test_nonfused_passthrough_keeps_per_parameter_skipping():
    model = mlp()
    opt = oc.wrap(torch.optim.AdamW(model.parameters(), lr=1e-2), "fp32")
    grads_of(model, 0)
    opt.step()
    grads_of(model, 1)
    model[0].weight.grad[1, 2] = float("inf")
    w0 = model[0].weight.detach().clone()
    b2 = model[2].bias.detach().clone()
    opt.step()
    assert torch.equal(model[0].weight, w0) and not torch.equal(model[2].bias, b2)
    assert opt.memory_report()["nonfinite_skipped"] == 1


def test_a_backward_check_describes_only_the_unchanged_gradient():
    """backward_check.py uses a maximum taken in backward only for the very tensor it saw:
    same object, storage and version; any in-place change, a new tensor or a swapped storage
    sends the gradient back to the step's own check."""
    from optstate_core.step.backward_check import _Seen
    g = torch.randn(8, 8)
    seen = _Seen(g, g.abs().max().reshape(1), 0)
    assert seen.describes(g)
    assert not seen.describes(g.clone())  # a gradient replaced by another tensor
    g.mul_(0.5)  # clipping, unscaling, an accumulating backward: the version moves
    assert not seen.describes(g)
    seen = _Seen(g, g.abs().max().reshape(1), 0)
    g.data = torch.randn(8, 8)  # a swapped storage (torch does not count it as a version)
    assert not seen.describes(g)


def test_the_backward_check_stays_off_on_the_cpu():
    """On the CPU nothing is taken in backward (no stream to overlap with): every gradient is
    checked in the step, as the engine's plan never activates it there."""
    model = mlp()
    opt = oc.wrap(torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True), "fp32")
    for s in range(3):
        grads_of(model, s)
        opt.step()
    check = opt._engine.backward_check
    assert not check.active and check.used == 0
    check.watch(model.parameters())  # even if asked to: CPU gradients are not observed
    check.observe(next(model.parameters()))
    known, unknown = check.split(list(model.parameters()))
    assert known == [] and len(unknown) == len(list(model.parameters()))
