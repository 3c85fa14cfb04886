"""optstate_lightning with policy="auto": the LightningModule planned when its optimizer is wrapped."""
import logging

import pytest

pytest.importorskip("lightning")

import torch  # noqa: E402

import optstate_core as oc  # noqa: E402
from lightning_helpers import Regressor, loader, trainer  # noqa: E402
from optstate_lightning import OptStateCallback, OptStateConfig  # noqa: E402


def test_callback_plans_the_module_on_its_device(caplog):
    model, cb = Regressor(), OptStateCallback("auto", micro_batch=8)
    with caplog.at_level(logging.INFO, logger="optstate.auto"):
        trainer(callbacks=[cb], max_epochs=1).fit(model, loader())
    (opt,) = cb.optimizers
    assert opt.policy.describe() == oc.make_policy("8bit").describe() and opt.step_count == 8
    (line,) = [r.getMessage() for r in caplog.records if r.name == "optstate.auto"]
    assert line.startswith("optstate auto: 8bit, release_gradients=False") and "micro-batch 8" in line


def test_a_cap_releases_and_bad_options_are_named():
    model = Regressor()
    config = OptStateConfig("auto", wrap_options={"gpu_memory": "1GB", "activations": "1MB", "max_grad_norm": 1.0})
    opt = config.wrap(torch.optim.AdamW(model.parameters()), model)
    assert opt.release_gradients and opt.max_grad_norm == 1.0
    with pytest.raises(ValueError, match="gpu_budget: policy='auto' chooses it"):
        OptStateCallback("auto", gpu_budget="1GB")
    with pytest.raises(ValueError, match="model: preset 'auto' plans from the model"):
        config.wrap(torch.optim.AdamW(model.parameters()), None)
    with pytest.raises(ValueError, match="activations: preset 'auto' estimates"):
        OptStateConfig("auto", wrap_options={"gpu_memory": "1GB"}).wrap(torch.optim.AdamW(model.parameters()), model)
