"""Every torch.optim optimizer x the presets of docs/compatibility.md: each row wraps and trains (or
is refused with its reason); states of their own shape (Adafactor's factored statistics) are kept
as they are; the per-optimizer codecs the presets pick."""
import copy
import re
from pathlib import Path

import pytest
import torch

import optstate_core as oc
from optstate_core.apps import compat

ROOT = Path(__file__).resolve().parents[1]
REFUSED = {"LBFGS": "LBFGS re-evaluates the closure", "SparseAdam": "SparseAdam steps sparse gradients"}
ROWS = [(name, preset) for name in compat.torch_optimizers() for preset in compat.PRESETS_COMPARED]


def small_task(name, seed=0):
    """The compat task's data with a smaller student (same layer kinds): cheap rows."""
    _, (x, y), _, gen = compat.task(seed, bias=name != "Muon")
    torch.manual_seed(seed)
    bias = name != "Muon"
    model = torch.nn.Sequential(torch.nn.Linear(64, 96, bias=bias), torch.nn.GELU(), torch.nn.Linear(96, 8, bias=bias))
    return model, x[:256], y[:256]


def train(model, opt, x, y, steps):
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def test_every_torch_optimizer_has_settings_and_a_row_in_the_docs():
    names = compat.torch_optimizers()
    assert {"Adam", "AdamW", "SGD", "Adafactor", "LBFGS", "SparseAdam"} <= set(names)
    assert set(names) <= set(compat.SETTINGS), set(names) - set(compat.SETTINGS)
    table = (ROOT / "docs" / "compatibility.md").read_text()
    for name in names:
        for preset in compat.PRESETS_COMPARED:
            assert re.search(rf"^\| {name} \| `{preset}` \|", table, re.M), (name, preset)


@pytest.mark.parametrize("name,preset", ROWS, ids=[f"{n}-{p}" for n, p in ROWS])
def test_row(name, preset):
    """The row works as the table says: refused optimizers get a clear reason at wrap; the others
    train a few steps to a finite loss with less state than fp32 holds (the same with `fp32`),
    and `fp32` is the unwrapped optimizer bit for bit."""
    model, x, y = small_task(name)
    inner = getattr(torch.optim, name)(model.parameters(), **compat.SETTINGS[name])
    if name in REFUSED:
        with pytest.raises(ValueError, match=REFUSED[name]):
            oc.wrap(inner, preset)
        return
    opt = oc.wrap(inner, preset)
    train(model, opt, x, y, 3)
    ref_model, _, _ = small_task(name)
    ref = getattr(torch.optim, name)(ref_model.parameters(), **compat.SETTINGS[name])
    train(ref_model, ref, x, y, 3)
    report = opt.memory_report()
    fp32_bits = 8 * sum(v.numel() * v.element_size() for s in ref.state.values() for v in s.values()
                        if isinstance(v, torch.Tensor) and v.dim() > 0) / report["n_params"]
    assert report["bits_per_param"] <= fp32_bits + 1e-9
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert torch.isfinite(p).all()
        if preset == "fp32":
            assert torch.equal(p, q)


@pytest.mark.parametrize("preset", compat.PRESETS_COMPARED)
def test_adafactor_keeps_its_factored_statistics_and_matches_unwrapped(preset):
    """Adafactor's row/column statistics (shapes [rows, 1] and [1, cols]) stay plain tensors of
    their own shape beside the parameter in every preset, offload included; a 1-D parameter of
    4096+ elements keeps its `variance` in the preset's codec. With the compressed variance the
    run stays close to the unwrapped one; the factored matrices are updated exactly as unwrapped."""
    def build():
        torch.manual_seed(0)
        return torch.nn.ParameterList([torch.nn.Parameter(torch.randn(64, 80) * 0.1),
                                       torch.nn.Parameter(torch.randn(4096) * 0.1)])
    ps, ref_ps = build(), build()
    opt = oc.wrap(torch.optim.Adafactor(ps, lr=1e-2), preset)
    ref = torch.optim.Adafactor(ref_ps, lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    for _ in range(4):
        grads = [torch.randn(p.shape, generator=gen) for p in ps]
        for p, q, g in zip(ps, ref_ps, grads):
            p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
    st = opt.state[ps[0]]
    assert type(st["row_var"]) is torch.Tensor and tuple(st["row_var"].shape) == (64, 1)
    assert type(st["col_var"]) is torch.Tensor and tuple(st["col_var"].shape) == (1, 80)
    assert st["row_var"].device == ps[0].device
    assert torch.equal(ps[0], ref_ps[0]) and torch.equal(st["col_var"], ref.state[ref_ps[0]]["col_var"])
    variance = opt.state[ps[1]]["variance"]
    assert isinstance(variance, oc.EncodedTensor) == (preset != "fp32")
    assert (ps[1] - ref_ps[1]).abs().max() <= 0.02 * ref_ps[1].abs().max()


def test_adafactor_checkpoint_round_trip_continues_exactly():
    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.GELU(), torch.nn.Linear(96, 8))
        return model, oc.wrap(torch.optim.Adafactor(model.parameters(), lr=1e-2), "8bit")
    _, (x, y), _, _ = compat.task(0, bias=True)
    model, opt = build()
    train(model, opt, x[:128], y[:128], 3)
    saved = copy.deepcopy(opt.state_dict())  # as torch's, state_dict() holds the live tensors
    model_state = {k: v.clone() for k, v in model.state_dict().items()}
    train(model, opt, x[128:256], y[128:256], 2)
    again, opt2 = build()
    again.load_state_dict(model_state)
    opt2.load_state_dict(saved)
    train(again, opt2, x[128:256], y[128:256], 2)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), again.parameters()))


def test_a_non_elementwise_optimizer_declared_elementwise_is_refused_at_wrap():
    ps = [torch.nn.Parameter(torch.randn(64, 80))]
    with pytest.raises(ValueError, match="elementwise=True: Adafactor"):
        oc.wrap(torch.optim.Adafactor(ps), "8bit", elementwise=True)


def test_presets_pick_a_codec_per_optimizer():
    """SGD's momentum rounds stochastically at 4 bits; Muon's momentum is int8 with nearest
    rounding in every compressed preset; Adam's moments are untouched by it."""
    info = oc.ParamInfo(0, 0, (512, 512), torch.float32, None)

    def codec(preset, opt_cls, key, **kw):
        policy = oc.make_policy(preset)
        policy.bind_optimizer(opt_cls([torch.nn.Parameter(torch.zeros(2, 2))], **kw))
        return policy.codec_for(info, key, 0)
    sgd4 = codec("4bit", torch.optim.SGD, "momentum_buffer", lr=0.1, momentum=0.9)
    assert sgd4.name == "int4" and sgd4.stochastic_rounding
    for preset in ("8bit", "4bit", "offload", "4bit-all", "bf16w-4bit-lean"):
        muon = codec(preset, torch.optim.Muon, "momentum_buffer")
        assert muon.name == "int8" and not muon.stochastic_rounding, preset
    adam = codec("4bit", torch.optim.Adam, "exp_avg")
    assert adam.name == "int4" and not adam.stochastic_rounding
    info = oc.ParamInfo(0, 0, (8, 256), torch.float32, None)  # under min_int8_elements: fp32 whatever the optimizer
    assert codec("offload", torch.optim.Muon, "momentum_buffer").name == "fp32"
    assert codec("4bit", torch.optim.SGD, "momentum_buffer", lr=0.1, momentum=0.9).name == "fp32"


def test_a_policy_serves_one_optimizer_when_its_codecs_tell_them_apart():
    policy = oc.make_policy("4bit")
    oc.wrap(torch.optim.SGD([torch.nn.Parameter(torch.zeros(4))], lr=0.1, momentum=0.9), policy)
    oc.wrap(torch.optim.SGD([torch.nn.Parameter(torch.zeros(4))], lr=0.1, momentum=0.9), policy)  # same class: fine
    before = dict(policy._cache)
    with pytest.raises(ValueError, match="serves a SGD already"):
        oc.wrap(torch.optim.Muon([torch.nn.Parameter(torch.zeros(4, 4))]), policy)
    assert policy._optimizer == "SGD" and policy._cache == before


@pytest.mark.parametrize("bad,match", [({"SGD": "int8"}, "entry 'SGD'"), ({"SGD": {"momentum_buffer": "int3"}},
                                                                           r"optimizer_codecs\['SGD'\]"),
                                       (["SGD"], "must be a mapping")])
def test_bad_optimizer_codecs_name_the_argument(bad, match):
    with pytest.raises(ValueError, match=match):
        oc.WarmupPolicy(optimizer_codecs=bad)


def test_sgd_momentum_at_4_bits_holds_its_loss():
    """Nearest 4-bit rounding stalls SGD's momentum buffer (m <- mu*m + g); the preset's stochastic
    rounding keeps the compat task's held-out loss within the table's bound (one seed, 100 steps)."""
    base = compat.run_one("SGD", None, 0, 100).loss
    got = compat.run_one("SGD", "4bit", 0, 100).loss
    assert abs(got / base - 1) <= compat.HOLDS / 100


def test_compat_table_renders_rows_verdicts_and_recommendations():
    table = compat.compat_rows(["SGD", "LBFGS"], ["fp32", "8bit"], seeds=2, steps=2)
    text = compat.to_markdown(table, 2, 2, "# t")
    assert "| SGD | `fp32` | yes | 32.0 |" in text and "+0.00%, +0.00% | holds |" in text
    assert "| LBFGS | `8bit` | no: optimizer: LBFGS" in text
    assert "- LBFGS: cannot be wrapped" in text and "- SGD: `8bit`" in text
