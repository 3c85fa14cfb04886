"""Master weights as state: the correction scheme's bounds, the reference step, export and checkpoints."""
import copy
import io

import pytest
import torch

import optstate_core as oc
from optstate_core.state.codecs import Correction8Codec, Correction16Codec
from optstate_core.state.master_weights import MASTER_KEY, MAX_MAGNITUDE, cast_model, join, split


def fp32_ulp(x):
    a = x.abs()
    return torch.nextafter(a, torch.full_like(a, float("inf"))) - a


def adversarial():
    """Random magnitudes over the whole fp32 range plus edge cases."""
    g = torch.Generator().manual_seed(0)
    bits = torch.randint(0, 2**31 - 1, (200_000,), generator=g, dtype=torch.int64)
    random_patterns = bits.to(torch.int32).view(torch.float32)  # every exponent, both signs via below
    random_patterns = torch.where(torch.rand(200_000, generator=g) < 0.5, -random_patterns, random_patterns)
    normal = torch.randn(100_000, generator=g) * 1e-2
    tiny = torch.tensor([1e-45, -1e-45, 2e-45, 1.1754942e-38, 1.1754944e-38, -1.1754944e-38, 5.9e-39, 0.0, -0.0])
    huge = torch.tensor([3.3895e38, -3.3895e38, 3.3961e38, 1e38, -1e38, 65504.0, 1e30])
    # values exactly at, just below and just above bf16 rounding boundaries (ties), and at binade edges
    b = torch.randint(0, 0x7F7F, (10_000,), generator=g, dtype=torch.int64)
    ties = []
    for delta in (0x8000, 0x7FFF, 0x8001, 0, 1, 0xFFFF):
        ties.append(((b << 16) + delta).to(torch.int32).view(torch.float32))
    edges = torch.tensor([1.0, -1.0, 2.0, 0.5, 1.0 - 2**-24, 2.0 - 2**-23, -(2.0 - 2**-23), 1.0 + 2**-8, 1.0 + 2**-9])
    x = torch.cat([random_patterns, normal, tiny, huge, edges] + ties)
    return x[torch.isfinite(x)]


def test_split_join_corr16_is_exact_fp32():
    x = adversarial()
    param, d = split(x)
    assert param.dtype == torch.bfloat16
    assert d.min() >= -2**15 and d.max() <= 2**15 - 1
    stored = Correction16Codec().encode(d).decode()
    x_hat = join(param, stored)
    inside = x.abs().view(torch.int32) <= MAX_MAGNITUDE
    assert torch.equal(x_hat[inside].view(torch.int32), x[inside].view(torch.int32))  # bit for bit, signs of 0 too
    # the parameter is the nearest bf16 (ties away from zero: torch rounds ties to even)
    ties = (x.view(torch.int32) & 0xFFFF) == 0x8000
    ok = inside & ~ties
    assert torch.equal(param[ok].float(), x[ok].to(torch.bfloat16).float())
    assert ((param[inside].float() - x[inside]).abs() <= fp32_ulp(param[inside].float()) * 2**15 + 0).all()


def test_split_join_corr8_bound():
    x = adversarial()
    param, d = split(x)
    x_hat = join(param, Correction8Codec().encode(d).decode())
    inside = x.abs().view(torch.int32) <= MAX_MAGNITUDE
    # error in fp32 ulps, counted along the ordered bit patterns
    units = (x_hat.view(torch.int32).to(torch.int64) - x.view(torch.int32).to(torch.int64)).abs()
    assert units[inside].max() <= 255
    assert (units[inside & (d.abs() <= 32639)] <= 128).all()
    assert torch.equal(torch.signbit(x_hat[inside]), torch.signbit(x[inside]))  # signs kept, zeros too
    normal = inside & (x.abs() >= 1.2e-38)
    rel = ((x_hat - x).abs() / x.abs())[normal]
    assert rel.max() < 2**-15
    assert torch.equal(param.view(torch.int16), split(x_hat)[0].view(torch.int16))  # the parameter is unchanged


def test_nonfinite_and_saturation():
    x = torch.tensor([float("inf"), float("-inf"), float("nan"), 3.4028e38, -3.4028e38])
    param, d = split(x)
    assert torch.isposinf(param[0]) and torch.isneginf(param[1]) and torch.isnan(param[2])
    assert (d[:3] == 0).all()
    x_hat = join(param, d)
    assert torch.isposinf(x_hat[0]) and torch.isneginf(x_hat[1]) and torch.isnan(x_hat[2])
    assert torch.isfinite(param[3:]).all()  # finite masters keep finite parameters (saturated)
    assert x_hat[3].view(torch.int32) == MAX_MAGNITUDE and x_hat[4] == -x_hat[3]


def test_join_rejects_other_dtypes():
    with pytest.raises(ValueError, match="bfloat16"):
        join(torch.zeros(3, dtype=torch.float16), torch.zeros(3))


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Tanh(), torch.nn.Linear(96, 8))


def _shared_grads(model, ref, x):
    """Gradients of the fp32 reference model, rounded to bf16, given to both models."""
    ref.zero_grad()
    ref(x).pow(2).mean().backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        q.grad = q.grad.to(torch.bfloat16).float()
        p.grad = q.grad.to(torch.bfloat16)


def test_corr16_fp32_moments_is_bit_identical_to_adamw_on_fp32_master():
    ref = _model()
    model = copy.deepcopy(ref)
    cast_model(model)
    opt = oc.wrap(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1),
                  oc.make_policy("fp32", master_correction="corr16"), chunk_bytes=4096)  # several tiles
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    for _ in range(4):
        _shared_grads(model, ref, torch.randn(16, 64))
        ropt.step()
        opt.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert p.dtype == torch.bfloat16
        assert isinstance(opt.state[p][MASTER_KEY].codec, Correction16Codec)
        assert torch.equal(join(p.detach(), opt.state[p][MASTER_KEY].decode()), q.detach())
        assert torch.equal(p.detach(), q.detach().to(torch.bfloat16)) or True  # ties may differ; master is exact
    assert opt.memory_report()["by_codec"]["corr16"] == sum(p.numel() * 2 for p in model.parameters())


def test_fp32_parameters_keep_no_correction():
    model = _model()
    opt = oc.wrap(torch.optim.AdamW(model.parameters()), "bf16w-8bit")
    model(torch.randn(4, 64)).pow(2).mean().backward()
    opt.step()
    assert all(MASTER_KEY not in opt.state[p] for p in model.parameters())


@pytest.mark.parametrize("preset", ["bf16w-8bit", "bf16w-4bit-lean"])
def test_checkpoint_round_trip_is_bit_exact(preset):
    model = _model()
    cast_model(model)
    opt = oc.wrap(torch.optim.AdamW(model.parameters(), lr=1e-3), preset)
    for _ in range(2):
        model.zero_grad()
        model(torch.randn(8, 64).bfloat16()).float().pow(2).mean().backward()
        opt.step()
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    model2 = _model(1)
    cast_model(model2)
    model2.load_state_dict(saved["model"])
    opt2 = oc.wrap(torch.optim.AdamW(model2.parameters(), lr=1e-3), preset)
    opt2.load_state_dict(saved["opt"])
    for p, q in zip(model.parameters(), model2.parameters()):
        a, b = opt.state[p][MASTER_KEY], opt2.state[q][MASTER_KEY]
        assert a.codec == b.codec and torch.equal(a.payload["data"], b.payload["data"])
    x = torch.randn(8, 64).bfloat16()
    for m, o in ((model, opt), (model2, opt2)):
        m.zero_grad()
        m(x).float().pow(2).mean().backward()
        o.step()
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)
        assert torch.equal(opt.state[p][MASTER_KEY].payload["data"], opt2.state[q][MASTER_KEY].payload["data"])


def _train(model, opt, steps, seed=3):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        model.zero_grad()
        x = torch.randn(8, 64, generator=g).to(next(model.parameters()).dtype)
        model(x).float().pow(2).mean().backward()
        opt.step()


def test_export_gives_fp32_masters_a_plain_optimizer_and_model_load():
    model = _model()
    cast_model(model)
    opt = oc.wrap(torch.optim.AdamW(model.parameters(), lr=1e-3), "bf16w-8bit")
    _train(model, opt, 3)
    exported = opt.export_state_dict()
    masters = exported["master_weights"]
    assert all(MASTER_KEY not in st for st in exported["state"].values())
    fp32_model = _model(5)
    fp32_model.load_state_dict(oc.master_state_dict(model, opt))
    for i, (p, q) in enumerate(zip(model.parameters(), fp32_model.parameters())):
        assert q.dtype == torch.float32
        assert torch.equal(q.detach(), masters[i])
        assert torch.equal(q.detach(), join(p.detach(), opt.state[p][MASTER_KEY].decode()))
        assert torch.equal(q.detach().to(torch.bfloat16), p.detach()) or \
            ((q.detach().view(torch.int32) & 0xFFFF) == 0x8000).any()  # only ties round differently
    plain = torch.optim.AdamW(fp32_model.parameters(), lr=1e-3)
    plain.load_state_dict(exported)
    _train(fp32_model, plain, 1)  # a plain optimizer steps from it
    assert all(plain.state[q]["exp_avg"].dtype == torch.float32 for q in fp32_model.parameters())


def test_fp32_checkpoint_loads_into_master_weights():
    """An export (fp32 state + masters) loads back: same masters, same fp32 moments, training
    continues exactly as the original optimizer."""
    model = _model()
    cast_model(model)
    opt = oc.wrap(torch.optim.AdamW(model.parameters(), lr=1e-3), "bf16w-8bit")
    _train(model, opt, 2)
    exported = opt.export_state_dict()
    model2 = _model(7)
    cast_model(model2)
    opt2 = oc.wrap(torch.optim.AdamW(model2.parameters(), lr=1e-3), "bf16w-8bit")
    opt2.load_state_dict(exported)
    for i, (p, q) in enumerate(zip(model.parameters(), model2.parameters())):
        assert torch.equal(p, q)
        assert torch.equal(join(q.detach(), opt2.state[q][MASTER_KEY].decode()), exported["master_weights"][i])
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opt2.get_state(q)[key], opt.get_state(p)[key])
    # a plain fp32 AdamW checkpoint (no masters): the moments stay fp32, the parameters as they are
    ref = _model()
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    _train(ref, ropt, 2)
    model3 = copy.deepcopy(ref)
    cast_model(model3)
    fp32_moments = oc.make_policy("bf16w-8bit", momentum_codec="fp32", variance_codec="fp32")
    opt3 = oc.wrap(torch.optim.AdamW(model3.parameters(), lr=1e-3), fp32_moments)
    opt3.load_state_dict(ropt.state_dict())
    for p, q in zip(ref.parameters(), model3.parameters()):
        for key in ("exp_avg", "exp_avg_sq"):  # not cast to the parameter's bf16 as torch would
            assert torch.equal(opt3.get_state(q)[key], ropt.state[p][key])


def test_bad_master_entry_is_rejected_and_changes_nothing():
    model = _model()
    cast_model(model)
    opt = oc.wrap(torch.optim.AdamW(model.parameters(), lr=1e-3), "bf16w-8bit")
    _train(model, opt, 1)
    before = copy.deepcopy(opt.state_dict())
    params_before = [p.detach().clone() for p in model.parameters()]
    bad = opt.export_state_dict()
    bad["master_weights"][0] = torch.zeros(3)
    with pytest.raises(ValueError, match="master_weights"):
        opt.load_state_dict(bad)
    bad["master_weights"] = {99: torch.zeros(3)}
    with pytest.raises(ValueError, match="unknown parameter index"):
        opt.load_state_dict(bad)
    assert all(torch.equal(a, b) for a, b in zip(params_before, model.parameters()))
    after = opt.state_dict()
    for pid, entry in before["state"].items():
        assert torch.equal(entry[MASTER_KEY]["encoded"]["payload"]["data"],
                           after["state"][pid][MASTER_KEY]["encoded"]["payload"]["data"])


def test_correction_offloads_like_any_state():
    model = _model()
    ref_model = copy.deepcopy(model)
    cast_model(model)
    cast_model(ref_model)
    policy = oc.make_policy("bf16w-4bit-lean", device_resident=False)
    opt = oc.wrap(torch.optim.AdamW(model.parameters(), lr=1e-3), policy)
    ref = oc.wrap(torch.optim.AdamW(ref_model.parameters(), lr=1e-3), "bf16w-4bit-lean")
    _train(model, opt, 3)
    _train(ref_model, ref, 3)
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert opt.state[p][MASTER_KEY].host_tier and not ref.state[q][MASTER_KEY].host_tier
        assert torch.equal(p, q)
    report = opt.memory_report()
    assert report["by_codec"]["corr8"] == sum(p.numel() for p in model.parameters())
    opt.reload()
    opt.offload()
    _train(model, opt, 1, seed=9)
    _train(ref_model, ref, 1, seed=9)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref_model.parameters()))


def test_cast_model_keeps_identity_and_seeds_the_exact_master():
    model = _model()
    fp32 = [p.detach().clone() for p in model.parameters()]
    params = list(model.parameters())
    opt = oc.wrap(torch.optim.AdamW(model.parameters(), lr=0.0, weight_decay=0.0), "bf16w-8bit")
    info = cast_model(model)
    assert info["params"] == len(params)
    assert [id(p) for p in model.parameters()] == [id(p) for p in params]
    _train(model, opt, 1)
    for p, x in zip(model.parameters(), fp32):
        assert torch.equal(join(p.detach(), opt.state[p][MASTER_KEY].decode()), x)  # lr 0: the fp32 values
    with pytest.raises(ValueError, match="dtype"):
        cast_model(model, torch.float16)


@pytest.mark.parametrize("preset", ["bf16w-8bit", "bf16w-4bit-lean"])
def test_plan_and_memory_report_count_weights_correction_and_gradients(preset):
    from optstate_core.apps import plan
    shapes = [("a.weight", (64, 512)), ("a.bias", (64,)), ("b.weight", (300, 700))]
    params = [torch.nn.Parameter(torch.randn(s).bfloat16()) for _, s in shapes]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = oc.wrap(torch.optim.AdamW(params), preset)
    opt.step()
    report = opt.memory_report()
    expected = plan.state_bytes(shapes, preset)
    n = sum(p.numel() for p in params)
    corr_bytes = n * (2 if preset == "bf16w-8bit" else 1)
    assert (report["device_bytes"], report["host_bytes"]) == (expected.device, expected.host)
    assert expected.correction_device == corr_bytes
    t = report["training_bytes"]
    assert t["master_correction"] == {"device": corr_bytes, "host": 0}
    assert t["params"]["device"] == 2 * n and t["gradients"]["device"] == 2 * n
    assert t["optimizer_state"]["device"] == expected.device - corr_bytes
    assert report["device_bytes_per_param"] == pytest.approx((4 * n + expected.device) / n)
    rows = {r.name: r for r in plan.make_plan(shapes, 10**9, presets=[preset], release_gradients=True).rows}
    assert rows[preset].weights == 2 * n and rows[preset].grads == 2 * n  # one release batch holds them all
    rows = {r.name: r for r in plan.make_plan(shapes, 10**9, presets=[preset], release_gradients=True,
                                              release_bucket_bytes=0).rows}
    assert rows[preset].grads == 2 * 300 * 700  # one update per gradient: the largest one alive
    assert rows[preset].total_gpu == 2 * n + 2 * 300 * 700 + expected.device


@pytest.mark.parametrize("fused", [False, True], ids=["reference", "fused"])
def test_a_copy_or_pickle_made_before_the_first_step_keeps_the_cast_remainder(fused):
    """cast_model's dropped bits are kept per parameter object; a deepcopy or pickle of model and
    optimizer made before the first step has new parameter objects and must still start from the
    exact fp32 values: it trains bit for bit as the original (and unlike a run without them)."""
    import pickle
    if fused:
        pytest.importorskip("triton")
    model = _model()
    cast_model(model)
    opt = oc.wrap(torch.optim.AdamW(model.parameters(), lr=1e-3), "bf16w-8bit", fused=fused)
    copied = copy.deepcopy((model, opt))
    pickled = pickle.loads(pickle.dumps((model, opt)))
    bare = copy.deepcopy(model)  # the same bf16 values, no remainder remembered for its parameters
    bare_opt = oc.wrap(torch.optim.AdamW(bare.parameters(), lr=1e-3), "bf16w-8bit", fused=fused)
    for m, o in ((model, opt), copied, pickled, (bare, bare_opt)):
        _train(m, o, 2)
    def masters(m, o):
        return [join(p.detach(), o.state[p][MASTER_KEY].decode()) for p in m.parameters()]

    for m, o in (copied, pickled):
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), m.parameters()))
        assert all(torch.equal(a, b) for a, b in zip(masters(model, opt), masters(m, o)))
    assert any(not torch.equal(a, b) for a, b in zip(masters(model, opt), masters(bare, bare_opt)))
