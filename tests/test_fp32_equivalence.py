"""The fp32 codec path is bit-identical to the unwrapped torch optimizer, for any chunk size."""
import pytest
import torch

import optstate_core as oc
from helpers import flat_params, mlp, train_steps, two_groups

OPTIMIZERS = [
    (torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3)),
    (torch.optim.SGD, dict(lr=0.05, momentum=0.9, maximize=True)),
    (torch.optim.Adam, dict(lr=1e-3, amsgrad=True, weight_decay=1e-2)),
    (torch.optim.Adam, dict(lr=1e-3, maximize=True)),
    (torch.optim.AdamW, dict(lr=1e-3, amsgrad=True)),
    (torch.optim.AdamW, dict(lr=1e-3, weight_decay=0.1, foreach=False)),
    (torch.optim.Adamax, dict(lr=1e-3, weight_decay=1e-2)),
    (torch.optim.NAdam, dict(lr=1e-3, decoupled_weight_decay=True, weight_decay=1e-2)),
    (torch.optim.RAdam, dict(lr=1e-3, weight_decay=1e-2)),
    (torch.optim.RMSprop, dict(lr=1e-3, momentum=0.5, centered=True, weight_decay=1e-3)),
    (torch.optim.Adagrad, dict(lr=1e-2, weight_decay=1e-3)),
]

# Identity codec on the device (passthrough path) and identity codec "offloaded", which on CPU
# runs the tiled materialize -> inner step -> commit path with every chunk size below.
POLICIES = {
    "passthrough": lambda: oc.make_policy("fp32"),
    "tiled": lambda: oc.WarmupPolicy(warmup_steps=0, momentum_codec="fp32", variance_codec="fp32",
                                     device_resident=False),
}


def ids(case):
    cls, kw = case
    return cls.__name__ + "-" + "-".join(f"{k}" for k in kw if kw[k] is True or k == "weight_decay")


@pytest.mark.parametrize("case", OPTIMIZERS, ids=ids)
@pytest.mark.parametrize("path", sorted(POLICIES))
@pytest.mark.parametrize("chunk_bytes", [1024, 2**30])
def test_bit_identical_50_steps(case, path, chunk_bytes):
    cls, kw = case
    ref_model, model = mlp(width=96), mlp(width=96)
    ref = cls(two_groups(ref_model, lr=kw["lr"]), **kw)
    opt = oc.wrap(cls(two_groups(model, lr=kw["lr"]), **kw), POLICIES[path](), chunk_bytes=chunk_bytes)
    ref_losses = train_steps(ref_model, ref, 50)
    losses = train_steps(model, opt, 50)
    assert losses == ref_losses
    assert torch.equal(flat_params(model), flat_params(ref_model))
    for p_ref, p in zip(ref_model.parameters(), model.parameters()):
        mine = opt.get_state(p)
        for key, value in ref.state[p_ref].items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(mine[key].to(value.device), value), key
    if path == "tiled" and chunk_bytes == 1024:
        assert opt.last_step_timings["tiles"] > len(list(model.parameters()))  # weights were split


def test_closure_path_bit_identical():
    ref_model, model = mlp(), mlp()
    ref = torch.optim.AdamW(ref_model.parameters())
    opt = oc.wrap(torch.optim.AdamW(model.parameters()), "fp32")
    assert train_steps(model, opt, 10, closure=True) == train_steps(ref_model, ref, 10, closure=True)
    assert torch.equal(flat_params(model), flat_params(ref_model))
