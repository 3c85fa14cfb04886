"""Lightning with gradient release: gradient_clip_val is routed to the optimizer, value clipping refused."""
import pytest

pytest.importorskip("lightning")

import torch  # noqa: E402

from lightning_helpers import Regressor, loader, trainer  # noqa: E402
from optstate_lightning import OptStateCallback  # noqa: E402


def _fit(clip_val, algorithm=None):
    model = Regressor()
    cb = OptStateCallback("8bit", release_gradients=True, clip_mode="per_tensor")
    kwargs = {"gradient_clip_val": clip_val}
    if algorithm:
        kwargs["gradient_clip_algorithm"] = algorithm
    tr = trainer(callbacks=[cb], max_epochs=1, accumulate_grad_batches=2, **kwargs)
    tr.fit(model, loader())
    return tr, cb, model


def test_gradient_clip_val_is_routed_to_the_optimizer():
    tr, cb, model = _fit(0.05)
    opt = cb.optimizers[0]
    assert opt.release_gradients and opt.max_grad_norm == 0.05 and tr.gradient_clip_val is None
    assert opt.step_count == 4 and all(p.grad is None for p in model.parameters())
    assert float(opt.last_grad_norm) > 0.05
    _, cb2, unclipped = _fit(None)
    assert cb2.optimizers[0].max_grad_norm is None
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    params2 = torch.cat([p.detach().reshape(-1) for p in unclipped.parameters()])
    assert not torch.equal(params, params2)  # the clipping did act


def test_value_clipping_cannot_be_routed():
    with pytest.raises(ValueError, match="gradient_clip_algorithm='value'"):
        _fit(0.05, "value")


def test_the_capped_mode_through_lightning():
    """The 24 GB recipe's preset and a gpu_budget reach the optimizer through the callback; moving
    state to host memory changes no value (the same fit with the state resident)."""
    import optstate_core as oc

    results = []
    for preset, options in (("bf16w-4bit-lean", {}), ("bf16w-4bit-lean-offload", {}),
                            ("bf16w-4bit-lean", {"gpu_budget": 40000})):
        model = Regressor()
        oc.cast_model(model)
        cb = OptStateCallback(preset, release_gradients=True, **options)
        tr = trainer(callbacks=[cb], max_epochs=1, precision="bf16-true")  # bf16 inputs for the bf16 weights
        tr.fit(model, loader())
        opt = cb.optimizers[0]
        assert opt.release_gradients and opt.step_count > 0
        results.append((torch.cat([p.detach().float().reshape(-1) for p in model.parameters()]),
                        opt.memory_report()["host_bytes"]))
    (resident, host0), (offloaded, host1), (budgeted, host2) = results
    assert host0 == 0 and host1 > 0 and 0 < host2 < host1
    assert torch.equal(resident, offloaded) and torch.equal(resident, budgeted)
