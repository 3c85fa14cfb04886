"""optim="optstate_adamw_bf16w_*": a bf16 model trains with fp32 masters kept as optimizer state."""
import pytest
import torch

pytest.importorskip("transformers")

import optstate_core as oc  # noqa: E402
from optstate_core.state.master_weights import MASTER_KEY  # noqa: E402
import optstate_hf  # noqa: E402,F401
from hf_testlib import flat_params, make_trainer, one_thread, tiny_model  # noqa: E402,F401

pytestmark = pytest.mark.usefixtures("one_thread")


def bf16_model():
    model = tiny_model()
    oc.cast_model(model)
    return model


@pytest.mark.parametrize("name,release", [("optstate_adamw_bf16w_4bit_lean", True), ("optstate_adamw_bf16w_8bit", False),
                                          ("optstate_adamw_bf16w_4bit_lean_offload", True)])
def test_bf16w_names_train_with_master_corrections(tmp_path, name, release):
    optim_args = "min_int8_elements=0" + (",release_gradients=true" if release else "")
    model = bf16_model()
    before = flat_params(model)
    trainer = make_trainer(tmp_path, model=model, optim=name, optim_args=optim_args, max_steps=3, max_grad_norm=1.0)
    trainer.train()
    opt = trainer.optimizer.optimizer if not isinstance(trainer.optimizer, oc.VirtualOptimizer) else trainer.optimizer
    assert isinstance(opt, oc.VirtualOptimizer) and opt.release_gradients is release
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    corrections = [s[MASTER_KEY] for s in opt.state.values() if MASTER_KEY in s]
    assert len(corrections) == len(list(model.parameters()))  # every bf16 parameter has its master
    if name.endswith("offload"):  # the 24 GB recipe's name: moments and correction in host memory
        assert opt.memory_report()["device_bytes"] == 0 and all(c.host_tier for c in corrections)
    masters = oc.master_state_dict(model, opt)
    after = flat_params(model)
    assert not torch.equal(before, after)
    # each bf16 parameter is its master rounded (within half a bf16 ulp, <= 2**-8 relative), and the
    # masters carry what bf16 dropped
    for n, p in model.named_parameters():
        assert torch.allclose(masters[n], p.detach().float(), rtol=2**-8, atol=1e-30)
    assert any(not torch.equal(m, m.to(torch.bfloat16).float()) for m in masters.values())
    if release:  # the Trainer's clipping was routed to the optimizer, not dropped
        assert opt.max_grad_norm == 1.0 and trainer.args.max_grad_norm == 0.0
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in trainer.state.log_history if "loss" in h)
