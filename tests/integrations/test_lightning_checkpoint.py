"""optstate_lightning checkpoints: compressed state in ModelCheckpoint files, exact resume, plain
checkpoints migrated, offloaded state kept on the host through Lightning's device moves."""
import pytest

pytest.importorskip("lightning")

import torch  # noqa: E402
from lightning.fabric.utilities.optimizer import _optimizer_to_device  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

import optstate_core as oc  # noqa: E402
from lightning_helpers import Regressor, loader, trainer  # noqa: E402
from optstate_lightning import OptStateCallback  # noqa: E402


def encoded_values(opt):
    return [v for st in opt.state.values() for v in st.values() if isinstance(v, oc.EncodedTensor)]


POLICIES = {
    # everything compressed to int8 (small tensors too)
    "int8": lambda: oc.make_policy("8bit", min_int8_elements=0, whole_blocks_1d=False),
    # switches on a plateau during the first epoch: the phase must ride in the checkpoint
    "adaptive": lambda: oc.AdaptiveWarmupPolicy(warmup_steps=1000, patience=2, tol=0.3, momentum_codec="int8",
                                                variance_codec="int4", min_int8_elements=0, whole_blocks_1d=False),
}


@pytest.mark.parametrize("which", sorted(POLICIES))
def test_resume_continues_exactly(tmp_path, which):
    """ModelCheckpoint at the end of epoch 2; fit(ckpt_path=...) to epoch 4 must give the same
    losses and parameters as one uninterrupted run to epoch 4."""
    kw = dict(accumulate_grad_batches=2)
    full = Regressor(lr=3e-2)
    full_cb = OptStateCallback(policy=POLICIES[which]())
    trainer(callbacks=[full_cb], max_epochs=4, **kw).fit(full, loader())

    first = Regressor(lr=3e-2)
    ckpt_cb = ModelCheckpoint(dirpath=tmp_path, save_last=True, save_top_k=0)
    trainer(callbacks=[OptStateCallback(policy=POLICIES[which]()), ckpt_cb], max_epochs=2,
            enable_checkpointing=True, **kw).fit(first, loader())
    path = tmp_path / "last.ckpt"

    ckpt = torch.load(path, weights_only=True)  # tensors and primitives only
    opt_state = ckpt["optimizer_states"][0]
    assert opt_state["optstate"]["step"] == 8
    packed = [v["encoded"] for st in opt_state["state"].values() for v in st.values()
              if isinstance(v, dict) and "encoded" in v]
    assert packed and all(e["payload"]["codes"].dtype == torch.uint8 for e in packed)
    if which == "adaptive":
        assert opt_state["optstate"]["policy"]["switched"] is True

    resumed = Regressor(seed=123, lr=3e-2)  # other initial weights: they must come from the checkpoint
    cb = OptStateCallback(policy=POLICIES[which]())
    tr = trainer(callbacks=[cb], max_epochs=4, **kw)
    tr.fit(resumed, loader(), ckpt_path=str(path))
    assert resumed.losses == full.losses[16:]
    assert torch.equal(torch.cat([p.reshape(-1) for p in resumed.parameters()]),
                       torch.cat([p.reshape(-1) for p in full.parameters()]))
    assert tr.optimizers[0].step_count == 16 and encoded_values(tr.optimizers[0])
    if which == "adaptive":
        assert full_cb.switch_steps[0] < 8 and tr.optimizers[0].policy.switched


def test_resume_from_plain_adamw_checkpoint(tmp_path):
    """A checkpoint written without optstate loads into the wrapped optimizer (and gets compressed)."""
    ckpt_cb = ModelCheckpoint(dirpath=tmp_path, save_last=True, save_top_k=0)
    trainer(callbacks=[ckpt_cb], max_epochs=1, enable_checkpointing=True).fit(Regressor(), loader())
    model = Regressor(seed=5)
    tr = trainer(callbacks=[OptStateCallback(policy="8bit")], max_epochs=2)
    tr.fit(model, loader(), ckpt_path=str(tmp_path / "last.ckpt"))
    opt = tr.optimizers[0]
    assert opt.step_count == 16 and encoded_values(opt)
    assert int(next(iter(opt.state.values()))["step"]) == 16


def test_offloaded_state_stays_on_host_through_lightning_moves(tmp_path):
    """Lightning moves every optimizer-state value to the root device after loading a checkpoint
    (and to CPU at teardown). Host-tier payloads must stay in host memory. On CPU the root device
    is the CPU, so the move to an accelerator is exercised with the 'meta' device; the real
    GPU case needs a GPU."""
    policy = oc.make_policy("offload", min_int8_elements=0, whole_blocks_1d=False)
    ckpt_cb = ModelCheckpoint(dirpath=tmp_path, save_last=True, save_top_k=0)
    trainer(callbacks=[OptStateCallback(policy=policy), ckpt_cb], max_epochs=1,
            enable_checkpointing=True).fit(Regressor(), loader())
    model = Regressor()
    tr = trainer(callbacks=[OptStateCallback(policy=policy)], max_epochs=2)
    tr.fit(model, loader(), ckpt_path=str(tmp_path / "last.ckpt"))
    opt = tr.optimizers[0]
    values = encoded_values(opt)
    assert values and all(v.host_tier and v.device.type == "cpu" for v in values)
    assert opt.state is opt.optimizer.state
    report = opt.memory_report()
    assert report["host_bytes"] > 0 and report["device_bytes"] == 0

    _optimizer_to_device(opt, torch.device("meta"))  # what Strategy.load_optimizer_state_dict does on a GPU
    moved = encoded_values(opt)
    assert len(moved) == len(values)
    assert all(v.host_tier and all(t.device.type == "cpu" for t in v.payload.values()) for v in moved)
    # ... and the state still steps
    x, y = next(iter(loader()))
    torch.nn.functional.mse_loss(model(x), y).backward()
    before = opt.step_count
    opt.step()
    assert opt.step_count == before + 1 and all(v.host_tier for v in encoded_values(opt))
