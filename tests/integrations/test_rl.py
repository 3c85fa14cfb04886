"""optstate_rl (docs/rl.md): the AdamW class RL frameworks load by dotted path, built from exactly the
keyword arguments verl and NeMo-RL pass, and their optimizer offload helpers routed to the phase
switch (stand-in modules of the same names: neither framework is installed here)."""
import importlib
import sys
import types

import pytest
import torch

import optstate_core as oc
from helpers import flat_params, mlp, train_steps


def verl_build(parameters, optimizer_impl, optimizer, lr, weight_decay, betas, override=None):
    """What verl's build_optimizer (verl/workers/config/optimizer.py) passes: lr and weight_decay,
    betas when the class name holds "adam", then override_optimizer_config's keys."""
    kwargs = {"lr": lr, "weight_decay": weight_decay}
    if "adam" in optimizer.lower():
        kwargs["betas"] = betas
    kwargs.update(override or {})
    return getattr(importlib.import_module(optimizer_impl), optimizer)(parameters, **kwargs)


def nemo_build(parameters, name, kwargs):
    """NeMo-RL: hydra's get_class on ``policy.optimizer.name``, called with the trainable parameters
    (a generator) and ``policy.optimizer.kwargs``."""
    module, _, cls = name.rpartition(".")
    return getattr(importlib.import_module(module), cls)((p for p in parameters if p.requires_grad), **kwargs)


def reference(preset, steps=4, lr=1e-3, weight_decay=0.01):
    model = mlp(0)
    opt = oc.wrap(torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-8,
                                    weight_decay=weight_decay), preset)
    train_steps(model, opt, steps)
    return flat_params(model)


def test_verl_builds_it_by_dotted_path_and_it_parks_and_wakes():
    model = mlp(0)
    opt = verl_build(model.parameters(), "optstate_rl", "AdamW", lr=1e-3, weight_decay=0.01, betas=[0.9, 0.999],
                     override={"preset": "4bit"})
    assert isinstance(opt, torch.optim.Optimizer) and isinstance(opt, oc.VirtualOptimizer)
    assert opt.param_groups[0]["betas"] == (0.9, 0.999) and opt.policy.describe() == oc.make_policy("4bit").describe()
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)  # verl's schedulers are LambdaLRs
    train_steps(model, opt, 2)
    scheduler.step()
    opt.offload()
    assert opt.is_parked and opt.memory_report()["device_bytes"] == 0
    opt.reload()
    assert not opt.is_parked
    train_steps(model, opt, 2, seed=3)
    assert torch.equal(flat_params(model), reference("4bit"))


def test_the_default_preset_is_8bit_and_prepares_the_park():
    model = mlp(0)
    opt = verl_build(model.parameters(), "optstate_rl", "AdamW", lr=1e-3, weight_decay=0.01, betas=(0.9, 0.999))
    assert opt.policy.describe() == oc.make_policy("8bit").describe()
    assert opt._engine.park_buffers.after_first_step  # prepare_park() was asked before any state
    train_steps(model, opt, 2)
    opt.prepare_park(wait=True)
    assert opt.memory_report()["park_buffers"]["bytes"] == opt.memory_report()["device_bytes"] > 0
    with opt.parked():
        assert opt.is_parked
    train_steps(model, opt, 2, seed=3)
    assert torch.equal(flat_params(model), reference("8bit"))


def test_nemo_rl_builds_it_from_its_config_kwargs():
    model = mlp(0)
    opt = nemo_build(model.parameters(), "optstate_rl.AdamW",
                     {"lr": 1e-3, "weight_decay": 0.01, "betas": [0.9, 0.999], "eps": "1e-8", "preset": "8bit",
                      "foreach": False, "skip_nonfinite": False})
    assert isinstance(opt, oc.VirtualOptimizer) and opt.param_groups[0]["eps"] == 1e-8
    assert opt.param_groups[0]["foreach"] is False and opt._engine.skip_nonfinite is False
    train_steps(model, opt, 4)
    assert torch.equal(flat_params(model), reference("8bit"))


@pytest.mark.parametrize("kwargs, match", [
    ({"preset": "3bit"}, "unknown preset"),
    ({"betas": [0.9]}, "betas must be two numbers"),
    ({"prepare_park": "yes"}, "prepare_park must be True or False"),
    ({"framework_hooks": 1}, "framework_hooks must be True or False"),
])
def test_bad_arguments_are_named(kwargs, match):
    from optstate_rl import AdamW
    with pytest.raises(ValueError, match=match):
        AdamW(mlp(0).parameters(), **kwargs)


def test_an_unknown_keyword_is_refused():
    from optstate_rl import AdamW
    with pytest.raises(TypeError, match="no_such_option"):
        AdamW(mlp(0).parameters(), no_such_option=1)


def _module(monkeypatch, name, **attrs):
    module = types.ModuleType(name)
    for key, value in attrs.items():
        setattr(module, key, value)
    monkeypatch.setitem(sys.modules, name, module)
    return module


def test_verl_offload_helpers_park_and_wake_an_optstate_optimizer(monkeypatch):
    calls = []

    def offload_fsdp_optimizer(optimizer):
        calls.append(("offload", optimizer))

    def load_fsdp_optimizer(optimizer, device_id):
        calls.append(("load", optimizer, device_id))

    for name in ("verl", "verl.utils"):
        _module(monkeypatch, name)
    utils = _module(monkeypatch, "verl.utils.fsdp_utils", offload_fsdp_optimizer=offload_fsdp_optimizer,
                    load_fsdp_optimizer=load_fsdp_optimizer)
    workers = _module(monkeypatch, "verl.workers.fsdp_workers", offload_fsdp_optimizer=offload_fsdp_optimizer,
                      load_fsdp_optimizer=load_fsdp_optimizer)
    model = mlp(0)
    opt = verl_build(model.parameters(), "optstate_rl", "AdamW", lr=1e-3, weight_decay=0.01, betas=[0.9, 0.999])
    assert workers.offload_fsdp_optimizer is utils.offload_fsdp_optimizer is not offload_fsdp_optimizer
    train_steps(model, opt, 2)
    workers.offload_fsdp_optimizer(optimizer=opt)  # as verl's workers call them
    assert opt.is_parked and opt.memory_report()["device_bytes"] == 0
    workers.load_fsdp_optimizer(optimizer=opt, device_id=0)
    assert not opt.is_parked and calls == []
    plain = torch.optim.AdamW(mlp(1).parameters())
    workers.offload_fsdp_optimizer(optimizer=plain)
    utils.load_fsdp_optimizer(plain, 0)
    assert calls == [("offload", plain), ("load", plain, 0)]  # any other optimizer: verl's own helpers
    from optstate_rl import install_hooks
    assert install_hooks() == []  # installed once
    train_steps(model, opt, 2, seed=3)
    assert torch.equal(flat_params(model), reference("8bit"))


def test_nemo_rl_move_optimizer_to_device_parks_and_wakes(monkeypatch):
    moved = []

    def move_optimizer_to_device(self, device):
        moved.append(device)

    name = "nemo_rl.models.policy.workers.dtensor_policy_worker_v2"
    impl = type("DTensorPolicyWorkerV2Impl", (), {"move_optimizer_to_device": move_optimizer_to_device,
                                                  "__module__": name})
    _module(monkeypatch, "nemo_rl")
    _module(monkeypatch, name, DTensorPolicyWorkerV2Impl=impl)
    model = mlp(0)
    worker = impl()
    worker.optimizer = nemo_build(model.parameters(), "optstate_rl.AdamW", {"lr": 1e-3, "weight_decay": 0.01})
    train_steps(model, worker.optimizer, 2)
    worker.move_optimizer_to_device("cpu")
    assert worker.optimizer.is_parked
    worker.move_optimizer_to_device("cuda")  # wakes onto the parameters' device (the CPU here)
    assert not worker.optimizer.is_parked and moved == []
    worker.optimizer = torch.optim.AdamW(mlp(1).parameters())
    worker.move_optimizer_to_device("cpu")
    assert moved == ["cpu"]  # any other optimizer: NeMo-RL's own method
