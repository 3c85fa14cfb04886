"""Policies: warmup and adaptive switching, small-tensor bypass, name rules, global shapes."""
import pytest
import torch

import optstate_core as oc
from helpers import mlp, train_steps


def kinds(opt, model):
    return {n: {k: type(v).__name__ for k, v in opt.state[p].items() if k != "step"}
            for n, p in model.named_parameters()}


def test_warmup_switches_at_step_n_and_keeps_values():
    model = mlp(width=128)
    opt = oc.wrap(torch.optim.AdamW(model.parameters()), oc.WarmupPolicy(warmup_steps=3, variance_codec="int8"))
    train_steps(model, opt, 3)
    w = model[0].weight
    assert isinstance(opt.state[w]["exp_avg"], torch.Tensor)
    assert not opt.memory_report()["compression_active"]
    before = {k: v.clone() for k, v in opt.state[w].items()}
    train_steps(model, opt, 1, seed=50)
    assert isinstance(opt.state[w]["exp_avg"], oc.EncodedTensor)
    assert opt.memory_report()["compression_active"]
    # the switch step encodes the freshly updated state: compare against an fp32 twin
    twin = mlp(width=128)
    twin_opt = torch.optim.AdamW(twin.parameters())
    train_steps(twin, twin_opt, 3)
    train_steps(twin, twin_opt, 1, seed=50)
    ref = twin_opt.state[twin[0].weight]["exp_avg"]
    got = opt.state[w]["exp_avg"].decode()
    assert (got - ref).abs().max() <= ref.abs().max() / 15
    assert not torch.equal(before["exp_avg"], got)


def test_small_tensor_bypass_and_rules():
    model = mlp(width=128)
    policy = oc.WarmupPolicy(warmup_steps=0, variance_codec="int4", min_int8_elements=4096,
                             rules={r"^4\.": "fp32", r"^2\.weight": {"exp_avg": "bf16"}})
    opt = oc.wrap(torch.optim.AdamW(model.parameters()), policy, named_parameters=model.named_parameters())
    train_steps(model, opt, 2)
    k = kinds(opt, model)
    assert k["0.weight"] == {"exp_avg": "EncodedTensor", "exp_avg_sq": "EncodedTensor"}
    assert opt.state[model[0].weight]["exp_avg_sq"].codec.name == "int4"
    assert k["0.bias"] == {"exp_avg": "Tensor", "exp_avg_sq": "Tensor"}  # 128 < 4096 elements
    assert k["4.weight"] == {"exp_avg": "Tensor", "exp_avg_sq": "Tensor"}  # rule: fp32
    mid = opt.state[model[2].weight]
    assert mid["exp_avg"].codec.name == "bf16" and mid["exp_avg_sq"].codec.name == "int4"


def test_param_names_from_groups():
    model = mlp(width=128)
    opt = oc.wrap(torch.optim.AdamW(model.named_parameters()),
                  oc.make_policy("8bit", rules={r"^0\.weight$": "fp32"}))
    train_steps(model, opt, 1)
    assert isinstance(opt.state[model[0].weight]["exp_avg"], torch.Tensor)
    assert isinstance(opt.state[model[2].weight]["exp_avg"], oc.EncodedTensor)


def test_rules_use_names_the_policy_learned():
    """``WarmupPolicy(named_parameters=...)`` and ``bind_names`` name parameters for ``rules``
    without ``wrap(named_parameters=...)``."""
    model = mlp(width=128)
    policy = oc.WarmupPolicy(warmup_steps=0, rules={r"^0\.weight$": "fp32"}, named_parameters=model)
    opt = oc.wrap(torch.optim.AdamW(model.parameters()), policy)
    late = oc.WarmupPolicy(warmup_steps=0, rules={r"^2\.weight$": "fp32"})
    other = mlp(width=128)
    opt2 = oc.wrap(torch.optim.AdamW(other.parameters()), late)
    late.bind_names(other.named_parameters())
    train_steps(model, opt, 1)
    train_steps(other, opt2, 1)
    assert isinstance(opt.state[model[0].weight]["exp_avg"], torch.Tensor)
    assert isinstance(opt.state[model[2].weight]["exp_avg"], oc.EncodedTensor)
    assert isinstance(opt2.state[other[2].weight]["exp_avg"], torch.Tensor)
    assert isinstance(opt2.state[other[0].weight]["exp_avg"], oc.EncodedTensor)


def test_adaptive_switches_on_plateau_from_closure():
    model = mlp(width=128)
    policy = oc.AdaptiveWarmupPolicy(warmup_steps=1000, patience=3, tol=0.5, variance_codec="int8")
    opt = oc.wrap(torch.optim.AdamW(model.parameters(), lr=1e-4), policy)
    # a relative tolerance of 50% makes every step after the first "stale"
    train_steps(model, opt, 3, closure=True)
    assert not policy.switched
    train_steps(model, opt, 1, closure=True)
    assert policy.switched and opt.memory_report()["compression_active"]
    assert isinstance(opt.state[model[0].weight]["exp_avg"], oc.EncodedTensor)
    sd = opt.state_dict()
    assert sd["optstate"]["policy"]["switched"] is True
    fresh = oc.wrap(torch.optim.AdamW(mlp(width=128).parameters()),
                    oc.AdaptiveWarmupPolicy(warmup_steps=1000, patience=3, variance_codec="int8"))
    fresh.load_state_dict(sd)
    assert fresh.policy.switched


def test_adaptive_explicit_observe_loss_and_improvement_resets():
    policy = oc.AdaptiveWarmupPolicy(warmup_steps=100, patience=2, tol=0.0)
    for loss in [5.0, 4.0, 3.0, 3.0]:
        assert not policy.observe_loss(loss)
    assert policy.observe_loss(3.5)
    assert policy.switched and policy.active(0)
    assert not oc.AdaptiveWarmupPolicy().observe_loss(float("nan"))


def test_decisions_use_the_given_global_shape():
    policy = oc.make_policy("8bit")
    big = oc.ParamInfo(0, 0, (4096, 4096), torch.float32)
    shard = oc.ParamInfo(0, 0, (16, 128), torch.float32)  # what one rank of many might hold
    assert policy.codec_for(big, "exp_avg", 0).name == "int8"
    assert policy.codec_for(shard, "exp_avg", 0).name == "fp32"
    assert policy.codec_for(big, "step", 0).lossless  # unnamed keys are never compressed


@pytest.mark.parametrize("kwargs,match", [
    (dict(warmup_steps=-1), "warmup_steps"),
    (dict(variance_codec="int7"), "unknown codec"),
    (dict(min_int8_elements=-5), "min_int8_elements"),
    (dict(device_resident="yes"), "device_resident"),
    (dict(rules={"(": "fp32"}), "rules"),
    (dict(momentum_key=""), "momentum_key"),
])
def test_invalid_policy_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        oc.WarmupPolicy(**kwargs)


def test_adaptive_invalid_arguments():
    with pytest.raises(ValueError, match="patience"):
        oc.AdaptiveWarmupPolicy(patience=0)
    with pytest.raises(ValueError, match="tol"):
        oc.AdaptiveWarmupPolicy(tol=2.0)


@pytest.mark.parametrize("preset", sorted(oc.PRESETS))
def test_adaptive_policy_takes_every_option_of_the_preset(preset):
    """AdaptiveWarmupPolicy accepts every WarmupPolicy option (it lost iterate_codec when it listed
    them itself, so an ``*-it24`` preset with ``adaptive`` could not be built) and builds the same codecs."""
    options = oc.PRESETS[preset]
    plain, adaptive = oc.WarmupPolicy(**options), oc.AdaptiveWarmupPolicy(**options, patience=2)
    for attr in ("warmup_steps", "momentum_codec", "variance_codec", "iterate_codec", "small_tensor_codec",
                 "min_int8_elements", "device_resident", "master_correction", "master_tier"):
        assert getattr(adaptive, attr) == getattr(plain, attr), attr
    assert adaptive.patience == 2


def test_adaptive_policy_names_an_unknown_option():
    with pytest.raises(TypeError, match="no_such_option"):
        oc.AdaptiveWarmupPolicy(no_such_option=1)


def test_ragged_1d_states_take_the_small_tensor_codec_on_every_mesh():
    """A 1-D state that is not a whole number of blocks would straddle ranks when sharded, so it
    is fp32 in one process too (the reshard test checks the meshes); 2-D and aligned 1-D keep int4."""
    from optstate_core.policy import ParamInfo

    policy = oc.make_policy("4bit-all")
    codec = lambda shape: policy.codec_for(ParamInfo(0, 0, shape, torch.float32), "exp_avg", 0).name
    assert codec((3,)) == codec((4097,)) == "fp32"
    assert codec((512,)) == codec((2, 3)) == "int4"
    int8_all = oc.WarmupPolicy(warmup_steps=0, min_int8_elements=0, whole_blocks_1d=False)
    assert int8_all.codec_for(ParamInfo(0, 0, (3,), torch.float32), "exp_avg", 0).name == "int8"
    with pytest.raises(ValueError, match="whole_blocks_1d"):
        oc.WarmupPolicy(whole_blocks_1d=1)


def test_wrap_without_a_policy_is_the_default_preset():
    """One default: wrap(opt), VirtualOptimizer(opt), auto_wrap(opt) and wrap(opt, "default") build
    equal policies (same codecs, rounding and per-optimizer codecs)."""
    def settings(opt):
        return {k: repr(v) for k, v in vars(opt.policy).items() if not k.startswith("_")}

    make = lambda: torch.optim.AdamW(mlp().parameters())
    want = settings(oc.wrap(make(), "default"))
    assert want["momentum_codec"] == repr(oc.Int8Codec(stochastic_rounding=True))
    for opt in (oc.wrap(make()), oc.VirtualOptimizer(make()), oc.auto_wrap(make())):
        assert settings(opt) == want


def test_make_policy_builds_the_adaptive_policy():
    policy = oc.make_policy("4bit-it24", adaptive=True, warmup_steps=5, patience=3, tol=0.01)
    assert type(policy) is oc.AdaptiveWarmupPolicy and (policy.patience, policy.tol, policy.warmup_steps) == (3, 0.01, 5)
    assert policy.iterate_codec.name == "fp24"
    assert type(oc.make_policy("8bit")) is oc.WarmupPolicy
    with pytest.raises(TypeError, match="patience"):
        oc.make_policy("8bit", patience=3)  # patience without adaptive: not a WarmupPolicy option
