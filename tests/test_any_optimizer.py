"""Any optimizer, exactly: a wrapped third-party optimizer trains the same model as the optimizer
alone (lossless preset bit for bit: its groups, its state, its own methods, a resume mid-run), its
granularity is known or checked, and what cannot be wrapped is refused at ``wrap``."""
import importlib

import pytest
import torch

import optstate_core as oc
from optstate_core.step import granularity as gran

#: (row id, module, class, options): the third-party optimizers of the compatibility table
THIRD_PARTY = [
    ("schedulefree-AdamW", "schedulefree", "AdamWScheduleFree", dict(lr=1e-2, warmup_steps=3)),
    ("schedulefree-SGD", "schedulefree", "SGDScheduleFree", dict(lr=1e-2)),
    ("prodigy", "prodigyopt", "Prodigy", dict(lr=1.0, weight_decay=0.01)),
    ("optimi-AdamW", "optimi", "AdamW", dict(lr=1e-2)),
    ("optimi-Lion", "optimi", "Lion", dict(lr=1e-3)),
    ("lion", "lion_pytorch", "Lion", dict(lr=1e-3, weight_decay=0.1)),
    ("came", "came_pytorch", "CAME", dict(lr=1e-3)),
    ("po-Lamb", "pytorch_optimizer", "Lamb", dict(lr=1e-2)),
    ("po-SOAP", "pytorch_optimizer", "SOAP", dict(lr=1e-2)),
    ("po-AdEMAMix", "pytorch_optimizer", "AdEMAMix", dict(lr=1e-2)),
    ("po-ADOPT", "pytorch_optimizer", "ADOPT", dict(lr=1e-2)),
    ("po-ScheduleFreeAdamW", "pytorch_optimizer", "ScheduleFreeAdamW", dict(lr=1e-2)),
    ("po-AdaBelief", "pytorch_optimizer", "AdaBelief", dict(lr=1e-2)),
    ("po-Adan", "pytorch_optimizer", "Adan", dict(lr=1e-2)),
    ("po-LaProp", "pytorch_optimizer", "LaProp", dict(lr=1e-2)),
]


def optimizer_class(module: str, name: str):
    return getattr(pytest.importorskip(module), name)


def model_and_data(seed=0):
    """A 5-layer MLP (Linear, GELU, LayerNorm, biases) and a fixed regression task."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.LayerNorm(64),
                                torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 4))
    gen = torch.Generator().manual_seed(100 + seed)
    return model, torch.randn(256, 16, generator=gen), torch.randn(256, 4, generator=gen)


def train(model, opt, x, y, steps, start=0):
    for i in range(start, start + steps):
        rows = slice(i % 8 * 32, (i % 8 + 1) * 32)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
        opt.step()


def has_modes(opt) -> bool:
    return callable(getattr(opt, "train", None)) and callable(getattr(opt, "eval", None))


def run(cls, options, preset=None, steps=12, wrap_options=None):
    model, x, y = model_and_data()
    inner = cls(model.parameters(), **options)
    opt = inner if preset is None else oc.wrap(inner, preset, **(wrap_options or {}))
    if has_modes(inner):
        opt.train()
    train(model, opt, x, y, steps)
    if has_modes(inner):
        opt.eval()  # schedule-free: the averaged iterate x, through the wrapper's own eval()
    return model, inner, opt


def plain_groups(groups):
    return [{k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in g.items() if k != "params"}
            for g in groups]


def assert_same_groups(a, b):
    for ga, gb in zip(plain_groups(a), plain_groups(b)):
        assert ga.keys() == gb.keys()
        for k in ga:
            if isinstance(ga[k], torch.Tensor):
                assert torch.equal(ga[k], gb[k]), k
            else:
                assert ga[k] == gb[k], (k, ga[k], gb[k])


@pytest.mark.parametrize("row,module,name,options", THIRD_PARTY, ids=[r[0] for r in THIRD_PARTY])
def test_fp32_preset_is_bit_identical_groups_and_state_included(row, module, name, options):
    cls = optimizer_class(module, name)
    ref_model, ref_inner, _ = run(cls, options)
    model, inner, opt = run(cls, options, "fp32")
    for p, q in zip(ref_model.parameters(), model.parameters()):
        assert torch.equal(p, q)
    assert_same_groups(ref_inner.param_groups, opt.param_groups)  # Prodigy's d and k, schedule-free's k ...
    for p, q in zip(ref_model.parameters(), model.parameters()):
        ref_state, state = ref_inner.state[p], opt.get_state(q)
        assert set(ref_state) == set(state)
        for key, value in ref_state.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, state[key].to(value.dtype)), key


@pytest.mark.parametrize("row,module,name,options", [r for r in THIRD_PARTY if r[0] in (
    "schedulefree-AdamW", "prodigy", "optimi-AdamW", "po-AdEMAMix")], ids=lambda r: r if isinstance(r, str) else "")
def test_fp32_resume_mid_run_is_bit_identical(row, module, name, options):
    """Save after 6 steps (schedule-free: in eval mode, as a Trainer saves after evaluating), load
    into a fresh model and wrapper, train 6 more: the unwrapped optimizer's 12 steps, bit for bit."""
    cls = optimizer_class(module, name)
    ref_model, x, y = model_and_data()
    ref = cls(ref_model.parameters(), **options)
    modes = has_modes(ref)
    if modes:
        ref.train()
    train(ref_model, ref, x, y, 6)
    if modes:
        ref.eval()
        ref.train()
    train(ref_model, ref, x, y, 6, start=6)

    model, _, _ = model_and_data()
    opt = oc.wrap(cls(model.parameters(), **options), "fp32")
    if modes:
        opt.train()
    train(model, opt, x, y, 6)
    if modes:
        opt.eval()
    saved_opt = opt.state_dict()
    saved_model = {k: v.clone() for k, v in model.state_dict().items()}

    resumed, _, _ = model_and_data(seed=5)
    resumed.load_state_dict(saved_model)
    opt2 = oc.wrap(cls(resumed.parameters(), **options), "fp32")
    opt2.load_state_dict(saved_opt)
    if modes:
        opt2.train()
    train(resumed, opt2, x, y, 6, start=6)
    for p, q in zip(ref_model.parameters(), resumed.parameters()):
        assert torch.equal(p, q)
    assert_same_groups(ref.param_groups, opt2.param_groups)


def test_prodigy_group_estimates_persist_and_schedulers_see_the_real_groups():
    cls = optimizer_class("prodigyopt", "Prodigy")
    _, ref, _ = run(cls, dict(lr=1.0), None, steps=12)
    model, inner, opt = run(cls, dict(lr=1.0), "8bit", steps=12)
    assert opt.param_groups[0] is inner.param_groups[0]
    assert opt.param_groups[0]["k"] == 12 and opt.param_groups[0]["d"] > 1e-5  # grew from d0 = 1e-6
    assert opt.param_groups[0]["d"] == pytest.approx(ref.param_groups[0]["d"], rel=0.01)  # int8 moments
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5)
    assert inner.param_groups[0]["lr"] == 0.5


def test_unknown_state_keys_stay_lossless_and_moments_compress():
    """Schedule-free's z and Prodigy's p0/s are iterates, not moments: raw fp32 in every preset."""
    cls = optimizer_class("schedulefree", "AdamWScheduleFree")
    model, inner, opt = run(cls, dict(lr=1e-2), "8bit", steps=3)
    big = model[3].weight
    assert isinstance(opt.state[big]["z"], torch.Tensor) and opt.state[big]["z"].dtype == torch.float32
    assert not isinstance(opt.state[big]["exp_avg_sq"], torch.Tensor)  # int8 encoded
    prodigy = optimizer_class("prodigyopt", "Prodigy")
    model, _, opt = run(prodigy, dict(lr=1.0), "4bit", steps=3)
    state = opt.state[model[3].weight]
    assert all(isinstance(state[k], torch.Tensor) for k in ("p0", "s"))
    assert not isinstance(state["exp_avg"], torch.Tensor)


def test_schedule_free_8bit_stays_close_to_unwrapped():
    """Stated bound: on this task, 40 steps, the wrapped 8-bit run's training loss within 2% of
    the unwrapped one (the compatibility table has the held-out gaps per seed)."""
    cls = optimizer_class("schedulefree", "AdamWScheduleFree")
    losses = []
    for preset in (None, "8bit"):
        model, _, _ = run(cls, dict(lr=1e-2), preset, steps=40)
        _, x, y = model_and_data()
        with torch.no_grad():
            losses.append(float(torch.nn.functional.mse_loss(model(x), y)))
    assert abs(losses[1] / losses[0] - 1) < 0.02, losses


class EMAOptimizer(torch.optim.Optimizer):
    """A made-up optimizer with a method outside ``step`` that writes its (compressed) moment."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["exp_avg"] = torch.zeros_like(p)
                st["exp_avg"].mul_(0.9).add_(p.grad, alpha=0.1)
                p.add_(st["exp_avg"], alpha=-g["lr"])

    def halve_momentum(self):
        for g in self.param_groups:
            for p in g["params"]:
                self.state[p]["exp_avg"].mul_(0.5)

    def momentum_norm(self):
        return sum(float(self.state[p]["exp_avg"].norm()) ** 2 for g in self.param_groups for p in g["params"]) ** 0.5


@pytest.mark.parametrize("call_on", ["wrapper", "inner"])
def test_other_methods_see_decoded_state_and_their_writes_persist(call_on):
    model, x, y = model_and_data()
    inner = EMAOptimizer(model.parameters())
    opt = oc.wrap(inner, "8bit")
    train(model, opt, x, y, 3)
    before = opt.momentum_norm()  # forwarded: runs on the decoded int8 state
    exact = sum(float(opt.get_state(p)["exp_avg"].norm()) ** 2 for p in model.parameters()) ** 0.5
    assert before == pytest.approx(exact, rel=1e-6)
    (opt if call_on == "wrapper" else inner).halve_momentum()
    assert not isinstance(opt.state[model[3].weight]["exp_avg"], torch.Tensor)  # stored encoded again
    assert opt.momentum_norm() == pytest.approx(before / 2, rel=0.02)  # int8: 2% bound


def test_private_attributes_are_not_forwarded():
    model, _, _ = model_and_data()
    opt = oc.wrap(torch.optim.Adam(model.parameters(), fused=False), "8bit")
    assert not hasattr(opt, "_step_supports_amp_scaling")
    with pytest.raises(AttributeError, match="no_such_thing"):
        opt.no_such_thing


# -- granularity --------------------------------------------------------------------------------------
def test_unknown_optimizers_take_one_call_per_step_and_say_so():
    model, x, y = model_and_data()
    opt = oc.wrap(EMAOptimizer(model.parameters()), "8bit")
    train(model, opt, x, y, 2)
    report = opt.memory_report()
    assert report["granularity"] == "step"
    assert report["transient_bytes"] >= 4 * sum(p.numel() for p in model.parameters() if p.numel() >= 4096)


REGISTERED = sorted(gran.REGISTRY.items())


@pytest.mark.parametrize("qualified,granularity", REGISTERED, ids=[q for q, _ in REGISTERED])
def test_each_registry_entry_matches_a_whole_step(qualified, granularity):
    """Every registry entry: stepping in its pieces gives the whole step's result bit for bit, on
    two steps of a model whose every parameter is 2-D (Muon) or has biases and a LayerNorm."""
    module, name = qualified.rsplit(".", 1)
    cls = getattr(pytest.importorskip(module), name)
    options = {"Muon": dict(lr=0.02), "SGD": dict(lr=0.1, momentum=0.9)}.get(name, dict(lr=1e-2))
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(16, 24)), torch.nn.Parameter(torch.randn(8, 16))]
    if name != "Muon":
        params.append(torch.nn.Parameter(torch.randn(24)))
    opt = cls(params, **options)
    for _ in range(2):
        for p in params:
            p.grad = torch.randn_like(p)
        states = [{k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in opt.state[p].items()}
                  for p in params]
        assert gran.check_against_whole(opt, granularity, params, states) is None
        opt.step()
    assert gran.registered(opt) == granularity


def test_a_wrong_granularity_is_refused_on_the_first_step_with_nothing_changed():
    cls = optimizer_class("prodigyopt", "Prodigy")
    model, x, y = model_and_data()
    opt = oc.wrap(cls(model.parameters(), lr=1.0), "8bit", granularity="tensor")
    before = [p.detach().clone() for p in model.parameters()]
    torch.nn.functional.mse_loss(model(x), y).backward()
    with pytest.raises(ValueError, match="granularity='tensor'.*Prodigy"):
        opt.step()
    assert all(torch.equal(p, q) for p, q in zip(before, model.parameters()))
    assert opt.param_groups[0]["k"] == 0 and len(opt.state) == 0


def test_a_right_granularity_declared_by_the_user_is_accepted():
    model, x, y = model_and_data()
    ref_model, _, _ = model_and_data()
    opt = oc.wrap(EMAOptimizer(model.parameters()), "fp32", granularity="elementwise")
    ref = EMAOptimizer(ref_model.parameters())
    train(model, opt, x, y, 4)
    train(ref_model, ref, x, y, 4)
    assert opt.memory_report()["granularity"] == "elementwise"
    assert all(torch.equal(p, q) for p, q in zip(ref_model.parameters(), model.parameters()))


def test_a_subclass_that_changes_step_is_not_taken_for_its_registered_base():
    class MyAdam(torch.optim.Adam):
        def step(self, closure=None):
            return super().step(closure)

    class SameAdam(torch.optim.Adam):
        pass

    model, _, _ = model_and_data()
    assert gran.registered(MyAdam(model.parameters())) is None
    assert gran.registered(SameAdam(model.parameters())) == "elementwise"


@pytest.mark.parametrize("kwargs,match", [
    (dict(granularity="rows"), "granularity must be"),
    (dict(granularity="step", elementwise=True), "contradicts"),
    (dict(release_gradients=True), "release_gradients=True: EMAOptimizer"),
])
def test_bad_granularity_options_are_refused_by_name(kwargs, match):
    model, _, _ = model_and_data()
    inner = EMAOptimizer(model.parameters())
    with pytest.raises(ValueError, match=match):
        oc.wrap(inner, "8bit", **kwargs)
    assert isinstance(inner.state, dict) and "halve_momentum" not in inner.__dict__


# -- refusals --------------------------------------------------------------------------------------------
def test_optimizers_with_quantized_state_are_refused_at_wrap():
    quantized = type("AdamW8bit", (EMAOptimizer,), {"__module__": "bitsandbytes.optim.adamw"})
    model, _, _ = model_and_data()
    with pytest.raises(ValueError, match="bitsandbytes.AdamW8bit cannot be wrapped"):
        oc.wrap(quantized(model.parameters()), "8bit")

    class Codes(torch.Tensor):
        pass

    inner = EMAOptimizer(model.parameters())
    inner.state[model[0].weight]["exp_avg"] = torch.zeros(3).as_subclass(Codes)
    with pytest.raises(ValueError, match="'exp_avg' is a Codes, a tensor subclass"):
        oc.wrap(inner, "8bit")


def test_real_quantized_optimizers_are_refused_when_installed():
    bnb = pytest.importorskip("bitsandbytes")
    model, _, _ = model_and_data()
    with pytest.raises(ValueError, match="cannot be wrapped"):
        oc.wrap(bnb.optim.AdamW8bit(model.parameters()), "8bit")


# -- iterates in 24 bits ---------------------------------------------------------------------------------
def test_fp24_codec_bound_and_idempotence():
    """Stated bound: |decode(encode(x)) - x| <= 255 fp32 ulps of x (< 2**-15 |x| for normal x);
    NaN/inf survive; re-encoding a decoded value returns it exactly."""
    codec = oc.get_codec("fp24")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 300, generator=g) * torch.exp(4 * torch.randn(64, 300, generator=g))
    x[0, :3] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    enc = codec.encode(x)
    y = enc.decode()
    assert enc.nbytes == 3 * x.numel()
    finite = torch.isfinite(x)
    ulp = torch.nextafter(x.abs(), torch.tensor(float("inf"))) - x.abs()
    assert ((y - x).abs()[finite] <= 255 * ulp[finite]).all()
    assert ((y - x).abs()[finite] < 2 ** -15 * x.abs()[finite]).all()
    assert y[0, 0].isnan() and y[0, 1] == float("inf") and y[0, 2] == -float("inf")
    assert torch.equal(codec.encode(y).decode()[finite], y[finite])


def test_schedule_free_iterate_in_fp24_keeps_four_bytes_and_its_loss():
    """``8bit-it24``: z as fp24 (3 B), v int8 (about 1 B) on the big tensors; the training loss
    within 2% of the unwrapped optimizer's (the 8-bit z-lossless bound above)."""
    cls = optimizer_class("schedulefree", "AdamWScheduleFree")
    model, _, opt = run(cls, dict(lr=1e-2), "8bit-it24", steps=40)
    state = opt.state[model[3].weight]
    assert state["z"].codec.name == "fp24" and state["exp_avg_sq"].codec.name == "int8"
    big = sum(state[k].nbytes for k in ("z", "exp_avg_sq")) / model[3].weight.numel()
    assert 4.0 <= big <= 4.1
    ref, x, y = model_and_data()
    ref_model, _, _ = run(cls, dict(lr=1e-2), None, steps=40)
    with torch.no_grad():
        losses = [float(torch.nn.functional.mse_loss(m(x), y)) for m in (ref_model, model)]
    assert abs(losses[1] / losses[0] - 1) < 0.02, losses


class GlobalCounterOptimizer(EMAOptimizer):
    """Keeps a counter under a non-parameter key of its state, as MADGRAD and SPAM do."""

    @torch.no_grad()
    def step(self, closure=None):
        self.state["k"] = self.state.get("k", 0) + 1
        for g in self.param_groups:
            g["lr"] = 0.1 / self.state["k"]
        super().step(closure)


def test_state_under_keys_of_its_own_persists_and_resumes():
    model, x, y = model_and_data()
    ref_model, _, _ = model_and_data()
    opt = oc.wrap(GlobalCounterOptimizer(model.parameters()), "8bit")
    ref = GlobalCounterOptimizer(ref_model.parameters())
    train(model, opt, x, y, 3)
    train(ref_model, ref, x, y, 3)
    assert opt.state["k"] == ref.state["k"] == 3
    saved = opt.state_dict()
    assert saved["state"]["k"] == 3
    resumed = oc.wrap(GlobalCounterOptimizer(model_and_data(seed=4)[0].parameters()), "8bit")
    resumed.load_state_dict(saved)
    assert resumed.state["k"] == 3 and resumed.param_groups[0]["lr"] == pytest.approx(0.1 / 3)


def test_an_optimizer_whose_state_is_a_read_only_property_is_refused():
    """pytorch-optimizer's Magma keeps its state behind a property: nothing can be put there."""
    class Delegating(EMAOptimizer):
        state = property(lambda self: {})

    model, _, _ = model_and_data()
    opt = object.__new__(Delegating)  # torch's __init__ would assign self.state
    opt.defaults, opt.param_groups = {"lr": 0.1}, [{"params": list(model.parameters()), "lr": 0.1}]
    with pytest.raises(ValueError, match="read-only property 'state'"):
        oc.wrap(opt, "8bit")


def test_an_optimizer_that_extends_its_checkpoint_is_warned_about(caplog):
    class Extended(EMAOptimizer):
        def state_dict(self):
            return {**super().state_dict(), "masks": 1}

    model, _, _ = model_and_data()
    with caplog.at_level("WARNING", logger="optstate"):
        oc.wrap(Extended(model.parameters()), "8bit")
        oc.wrap(EMAOptimizer(model.parameters()), "8bit")
    warned = [r.getMessage() for r in caplog.records if "overrides" in r.getMessage()]
    assert len(warned) == 1 and "Extended overrides state_dict()" in warned[0]
