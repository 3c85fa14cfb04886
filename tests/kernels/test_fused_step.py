"""The fused Adam/AdamW/SGD kernels against the reference path (decode -> torch step -> encode).

Stated bounds: parameters agree within fp32 round-off (|diff| <= 1e-6 + 1e-6 |p|: the kernel
computes bias corrections in fp32 on the device and may fuse multiply-adds); encoded states
agree code for code except where fp32 round-off moves a value across a rounding boundary
(at most 0.5% of codes, each such code one quantization step away). For bf16 parameters torch
rounds the decoded state to bf16 between its ops while the kernel keeps fp32: up to 10% of codes
then differ, again by one step.
"""
import copy
import logging

import pytest
import torch

import optstate_core as oc

pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = [(24, 700), (257,), (1, 1), (3, 256), (6, 130)]


def params(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter((torch.randn(s, generator=g) * 0.5).to(DEVICE, dtype)) for s in SHAPES]


def set_grads(ps, seed):
    g = torch.Generator().manual_seed(1000 + seed)
    for p in ps:
        p.grad = (torch.randn(p.shape, generator=g) * torch.exp(torch.randn(p.shape, generator=g))).to(DEVICE, p.dtype)


def policy(m, v):
    return oc.WarmupPolicy(warmup_steps=0, momentum_codec=m, variance_codec=v, min_int8_elements=0,
                           whole_blocks_1d=False)


def build(ps, cls, kw, pol, fused, **options):
    return oc.wrap(cls(ps, **kw), pol, fused=fused, **options)


def compare_states(ref_opt, opt, ref_ps, ps, min_same=0.995):
    for rp, p in zip(ref_ps, ps):
        for key, rv in ref_opt.state[rp].items():
            v = opt.state[p][key]
            if isinstance(rv, oc.EncodedTensor):
                assert isinstance(v, oc.EncodedTensor) and v.codec == rv.codec
                data = "codes" if "codes" in rv.payload else "data"
                same = (rv.payload[data] == v.payload[data]).float().mean().item()
                assert same >= min_same, (key, same)
                a, b = rv.decode(dtype=torch.float32), v.decode(dtype=torch.float32)
                step = a.abs().amax() / 8  # one int4 step at most (int8/bf16 steps are much smaller)
                assert ((a - b).abs() <= step + 1e-30).all(), key
            elif isinstance(rv, torch.Tensor) and rv.dim() > 0:
                torch.testing.assert_close(v, rv, rtol=1e-5, atol=1e-7)
            else:
                assert float(v) == float(rv), key


def run_pair(cls, kw, pol_fn, steps_before=2, dtype=torch.float32):
    ref_ps = params(dtype=dtype)
    ref = build(ref_ps, cls, kw, pol_fn(), fused=False)
    for s in range(steps_before):
        set_grads(ref_ps, s)
        ref.step()
    ps = [torch.nn.Parameter(p.detach().clone()) for p in ref_ps]
    opt = build(ps, cls, kw, pol_fn(), fused=True)
    if steps_before:
        opt.load_state_dict(copy.deepcopy(ref.state_dict()))  # like torch, loading aliases the tensors
    for s in range(steps_before, steps_before + 2):
        if s > steps_before:  # start each compared step from identical inputs
            with torch.no_grad():
                for p, rp in zip(ps, ref_ps):
                    p.copy_(rp)
            opt.load_state_dict(copy.deepcopy(ref.state_dict()))
        set_grads(ref_ps, s)
        set_grads(ps, s)
        ref.step()
        opt.step()
        assert opt.last_step_timings["fused_params"] == len(SHAPES)
        tol = 1e-6 if dtype == torch.float32 else 1e-2
        for rp, p in zip(ref_ps, ps):
            torch.testing.assert_close(p.float(), rp.float(), rtol=tol, atol=tol)
        # bf16 parameters: torch keeps the decoded state in bf16 between its ops, the kernel in fp32
        compare_states(ref, opt, ref_ps, ps, min_same=0.995 if dtype == torch.float32 else 0.9)
    return ref, opt


CODEC_PAIRS = [("int8", "int8"), ("int4", "int4"), ("bf16", "bf16"), ("int8", "fp32"), ("int4", "int8"),
               (oc.Int8Codec(stochastic_rounding=True), oc.Int4Codec(stochastic_rounding=True)),
               (oc.BF16Codec(stochastic_rounding=True), "int8")]


@pytest.mark.parametrize("m,v", CODEC_PAIRS, ids=lambda c: c if isinstance(c, str) else f"{c.name}-sr")
def test_adamw_matches_reference(m, v):
    run_pair(torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1), lambda: policy(m, v))


@pytest.mark.parametrize("kw", [dict(lr=1e-2, amsgrad=True, weight_decay=1e-2), dict(lr=1e-2, maximize=True),
                                dict(lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.0)],
                         ids=["amsgrad-l2", "maximize", "betas"])
def test_adam_options_match_reference(kw):
    run_pair(torch.optim.Adam, kw, lambda: policy("int8", "int8"))


def test_first_step_matches_reference():
    run_pair(torch.optim.AdamW, dict(lr=1e-2), lambda: policy("int4", "int8"), steps_before=0)


@pytest.mark.parametrize("kw", [dict(lr=0.1, momentum=0.9), dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3),
                                dict(lr=0.1, momentum=0.5, dampening=0.3, maximize=True)],
                         ids=["momentum", "nesterov-wd", "dampening-maximize"])
@pytest.mark.parametrize("codec", ["int8", "int4", "bf16"])
def test_sgd_matches_reference(kw, codec):
    pol = lambda: oc.WarmupPolicy(warmup_steps=0, momentum_codec=codec, min_int8_elements=0,
                                  whole_blocks_1d=False)  # noqa: E731
    run_pair(torch.optim.SGD, kw, pol)
    run_pair(torch.optim.SGD, kw, pol, steps_before=0)


def test_bf16_parameters():
    run_pair(torch.optim.AdamW, dict(lr=1e-2), lambda: policy("int8", "int8"), dtype=torch.bfloat16)


def poison_second_step(ps, clean, qs, opt, where, value):
    """Step both optimizers once, give both the next gradients, then put ``value`` at ``where`` in
    the first parameter's gradient of ``qs`` and a zero there in ``ps``'s."""
    for x, o in ((ps, clean), (qs, opt)):
        set_grads(x, 0)
        o.step()
        set_grads(x, 1)
    ps[0].grad[where] = 0.0
    qs[0].grad[where] = value


def fp32_pair(cls, kw, **options):
    """The fp32 preset on torch's fused optimizer (inner ``fused=True``) and torch's optimizer alone."""
    ps, qs = params(), params()
    return ps, qs, build(ps, cls, dict(kw, fused=True), "fp32", fused=True, **options), cls(qs, **kw, fused=True)


@pytest.mark.parametrize("kw", [dict(lr=1e-2, weight_decay=0.1), dict(lr=1e-2, amsgrad=True), dict(lr=1e-2, maximize=True)],
                         ids=["decay", "amsgrad", "maximize"])
def test_fp32_state_of_a_fused_optimizer_goes_to_the_kernel(kw):
    """The kernel steps fp32 state of a ``fused=True`` AdamW with torch's fused CUDA arithmetic
    (TORCH_FUSED; bit for bit on a GPU: tests/gpu/test_torch_fused_exact.py). Here, against torch's
    fused kernel of this device, which orders its arithmetic differently: within |diff| <= 1e-6 +
    2e-5 |x| after 4 steps (the CUDA arithmetic weighs the gradient by 1 - float32(beta): for
    beta2 = 0.999 that is 1.3e-5 off 0.001, relative)."""
    ps, qs, opt, ref = fp32_pair(torch.optim.AdamW, kw)
    for s in range(4):
        set_grads(ps, s)
        set_grads(qs, s)
        opt.step()
        ref.step()
        assert opt.last_step_timings["fused_params"] == len(SHAPES)
    for p, q in zip(ps, qs):
        torch.testing.assert_close(p, q, rtol=2e-5, atol=1e-6)
        for key, value in ref.state[q].items():
            got = opt.state[p][key]
            assert isinstance(got, torch.Tensor) and got.dtype == value.dtype, key
            torch.testing.assert_close(got, value, rtol=2e-5, atol=1e-6)


def test_fp32_state_skips_a_nonfinite_block_inside_the_kernel():
    """fp32 preset on a fused AdamW: a NaN/inf gradient leaves its 256-element block (parameter and
    both moments) as it was; every other element takes exactly the step it takes without it."""
    (ps, _, clean, _), (qs, _, opt, _) = (fp32_pair(torch.optim.AdamW, dict(lr=1e-2)) for _ in range(2))
    poison_second_step(ps, clean, qs, opt, (3, 300), float("inf"))
    before = [qs[0].detach().clone()] + [opt.state[qs[0]][k].clone() for k in ("exp_avg", "exp_avg_sq")]
    clean.step()
    opt.step()
    sk = torch.zeros(qs[0].shape, dtype=torch.bool, device=DEVICE)
    sk[3, 256:512] = True
    after = [qs[0]] + [opt.state[qs[0]][k] for k in ("exp_avg", "exp_avg_sq")]
    want = [ps[0]] + [clean.state[ps[0]][k] for k in ("exp_avg", "exp_avg_sq")]
    for b, a, w in zip(before, after, want):
        assert torch.equal(a[sk], b[sk]) and torch.equal(a[~sk], w[~sk])
    for p, q in zip(ps[1:], qs[1:]):
        assert torch.equal(p, q)
    assert opt.memory_report()["nonfinite_skipped"] == 1


@pytest.mark.parametrize("cls,kw", [(torch.optim.Adam, dict(lr=1e-2, weight_decay=0.01)),
                                    (torch.optim.AdamW, dict(lr=1e-2, fused=False))], ids=["adam-l2", "not-fused"])
def test_fp32_state_stays_with_torch_where_its_arithmetic_is_not_reproduced(cls, kw):
    ps = params()
    fused = kw.pop("fused", True)
    opt = build(ps, cls, dict(kw, fused=fused), "fp32", fused=True)
    set_grads(ps, 0)
    opt.step()
    assert opt.last_step_timings["fused_params"] == 0


def _skip_pair(first: bool, v_codec="int4", **options):
    """Two fused optimizers from identical state; the second sees NaN/inf (and a finite value
    >= 2**64) in some gradients, the first the same gradients with those entries zeroed.
    ``v_codec`` int8: the kernel reads the verdict off the second moment's block maxima."""
    ps, qs = params(), params()
    pol = lambda: policy("int8", v_codec)  # noqa: E731
    ref, opt = (build(x, torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1), pol(), fused=True, **options)
                for x in (ps, qs))
    if not first:
        for x, o in ((ps, ref), (qs, opt)):
            set_grads(x, 0)
            o.step()
    set_grads(ps, 1)
    set_grads(qs, 1)
    ps[0].grad[3, 5] = ps[0].grad[10, 600] = ps[2].grad[0, 0] = ps[3].grad[1, 7] = 0.0
    qs[0].grad[3, 5] = float("nan")
    qs[0].grad[10, 600] = float("-inf")
    qs[2].grad[0, 0] = float("inf")
    qs[3].grad[1, 7] = -(2.0 ** 65)  # finite, but its square overflows fp32
    before = [q.detach().clone() for q in qs]
    states = [{k: (v.clone() if isinstance(v, (torch.Tensor, oc.EncodedTensor)) else v) for k, v in opt.state[q].items()}
              for q in qs] if not first else None
    ref.step()
    opt.step()
    # the skipped blocks: 256-element runs of a row of the [rows, cols] layout
    skipped = [torch.zeros(q.shape, dtype=torch.bool, device=DEVICE) for q in qs]
    skipped[0][3, 0:256] = True
    skipped[0][10, 512:700] = True
    skipped[2][0, 0] = True
    skipped[3][1, :] = True
    return ps, qs, ref, opt, before, states, skipped


@pytest.mark.parametrize("v_codec", ["int4", "int8"])
@pytest.mark.parametrize("first", [False, True], ids=["later-step", "first-step"])
def test_nonfinite_gradient_skips_its_blocks_inside_the_kernel(first, v_codec):
    ps, qs, ref, opt, before, states, skipped = _skip_pair(first, v_codec)
    for p, q, b, sk in zip(ps, qs, before, skipped):
        assert torch.equal(q[sk], b[sk])  # skipped blocks: untouched
        assert torch.equal(q[~sk], p[~sk])  # every other block: exactly the finite run's update
        assert torch.isfinite(q).all()
    for i, (p, q, sk) in enumerate(zip(ps, qs, skipped)):
        for key in ("exp_avg", "exp_avg_sq"):
            got = opt.state[q][key].decode(dtype=torch.float32)
            want = ref.state[p][key].decode(dtype=torch.float32)
            assert torch.isfinite(got).all()
            assert torch.equal(got[~sk], want[~sk]), (i, key)
            old = torch.zeros_like(got) if first else states[i][key].decode(dtype=torch.float32)
            assert torch.equal(got[sk], old[sk]), (i, key)
        # the tensor as a whole took the step
        assert float(opt.state[q]["step"]) == float(ref.state[p]["step"]) == (1.0 if first else 2.0)
    assert opt.memory_report()["nonfinite_skipped"] == 3  # parameters with a skipped block
    assert ref.memory_report()["nonfinite_skipped"] == 0


def test_nonfinite_skip_of_streamed_state_matches_resident():
    _, qs, _, opt, _, _, _ = _skip_pair(False)
    _, rs, _, streamed, _, _, _ = _skip_pair(False, offload=True, staging_bytes="64KB")
    for q, r in zip(qs, rs):
        assert torch.equal(q, r)
    assert streamed.memory_report()["nonfinite_skipped"] == 3


def test_nonfinite_skips_count_each_parameter_once_per_step():
    """A parameter with skipped blocks counts once per step, however many of its blocks skip,
    even when its rows stream in separate pieces (rows 3 and 10 of the first parameter do here)."""
    _, qs, _, opt, _, _, _ = _skip_pair(False, offload=True, staging_bytes="8KB")
    assert opt.last_step_timings["kernel_launches"] > len(qs)  # pieces: more launches than parameters
    assert opt.memory_report()["nonfinite_skipped"] == 3
    opt.step()  # the same gradients again: three more
    assert opt.memory_report()["nonfinite_skipped"] == 6
    set_grads(qs, 2)
    opt.step()  # finite gradients: none
    assert opt.memory_report()["nonfinite_skipped"] == 6
    assert all(torch.isfinite(q).all() for q in qs)


def test_sgd_nonfinite_gradient_skips_its_block():
    ps, qs = params(), params()
    pol = lambda: oc.WarmupPolicy(warmup_steps=0, momentum_codec="int8", min_int8_elements=0,
                                  whole_blocks_1d=False)  # noqa: E731
    ref, opt = (build(x, torch.optim.SGD, dict(lr=0.1, momentum=0.9), pol(), fused=True) for x in (ps, qs))
    poison_second_step(ps, ref, qs, opt, (5, 300), float("nan"))
    before, buf = qs[0].detach().clone(), opt.state[qs[0]]["momentum_buffer"].decode()
    ref.step()
    opt.step()
    sk = torch.zeros(qs[0].shape, dtype=torch.bool, device=DEVICE)
    sk[5, 256:512] = True
    assert torch.equal(qs[0][sk], before[sk]) and torch.equal(qs[0][~sk], ps[0][~sk])
    got = opt.state[qs[0]]["momentum_buffer"].decode()
    assert torch.equal(got[sk], buf[sk]) and torch.equal(got[~sk], ref.state[ps[0]]["momentum_buffer"].decode()[~sk])
    assert all(torch.equal(p, q) for p, q in zip(ps[1:], qs[1:]))
    assert opt.memory_report()["nonfinite_skipped"] == 1


@pytest.mark.parametrize("kind,shapes,codecs", [("other", ((2, 2, 1, 0), (2, 2, 3, 0)), ("int8", "int4")),
                                                 ("int4", ((1, 1, 1, 0), (1, 1, 16, 64)), ("int4", "int4")),
                                                 ("int8", ((2, 2, 1, 0), (4, 2, 2, 0)), ("int8", "int8"))])
def test_tiles_per_program_do_not_change_results(monkeypatch, kind, shapes, codecs):
    """ITERS tiles per program (a loop in the kernel), or NBLK tiles side by side, give
    bit-identical parameters and states (each shape set through the environment, which a wrap()
    reads: every kind's shape, the ``kind`` the codecs pick among them)."""
    from optstate_core.tuning import SHAPE_ENV

    out = []
    for shape in shapes:
        for name, value in zip(SHAPE_ENV, shape):
            monkeypatch.setenv(name, str(value))
        ps = params()
        opt = build(ps, torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1), policy(*codecs), fused=True)
        for s in range(2):
            set_grads(ps, s)
            opt.step()
        out.append((ps, opt))
    (ps1, o1), (ps3, o3) = out
    for p, q in zip(ps1, ps3):
        assert torch.equal(p, q)
        for key in ("exp_avg", "exp_avg_sq"):
            a, b = o1.state[p][key], o3.state[q][key]
            assert all(torch.equal(a.payload[n], b.payload[n]) for n in a.payload)


def test_bad_launch_shape_override_names_the_variable(monkeypatch):
    """A launch-shape environment override that is not a count fails at wrap(), naming the
    variable; a valid one applies to optimizers wrapped after it is set (no new import)."""
    bad = [("OPTSTATE_ITERS", "0"), ("OPTSTATE_NBLK", "two"), ("OPTSTATE_MAXNREG", "-1")]
    for name, value in bad:
        with monkeypatch.context() as env:
            env.setenv(name, value)
            with pytest.raises(ValueError, match=f"{name} must be an integer") as failed:
                build(params(), torch.optim.AdamW, dict(lr=1e-2), policy("int8", "int8"), fused=True)
            assert repr(value) in str(failed.value)
    monkeypatch.setenv("OPTSTATE_NBLK", "2")
    opt = build(params(), torch.optim.AdamW, dict(lr=1e-2), policy("int8", "int8"), fused=True)
    assert {shape[0] for shape in opt._engine.kernels.shapes.values()} == {2}


def test_fallback_is_logged_once(caplog):
    ps = params()
    opt = build(ps, torch.optim.AdamW, dict(lr=1e-2), policy("int8", "int8"), fused=None if DEVICE == "cpu" else False)
    with caplog.at_level(logging.INFO, logger="optstate"):
        for s in range(2):
            set_grads(ps, s)
            opt.step()
    assert opt.last_step_timings["fused_params"] == 0
    if DEVICE == "cpu":
        assert caplog.text.count("reference path") == 1 and "need CUDA" in caplog.text


def test_unsupported_optimizer_falls_back():
    ps = params()
    opt = build(ps, torch.optim.NAdam, dict(lr=1e-2), policy("int8", "int8"), fused=True)
    set_grads(ps, 0)
    opt.step()
    assert opt.last_step_timings["fused_params"] == 0 and opt.step_count == 1


def test_small_launches_loop_less_to_fill_the_gpu(monkeypatch):
    """A launch with fewer programs than one wave of the GPU halves its loop count until it has
    enough (one parameter of gradient release, a small bucket); a whole model keeps its loops; the
    interpreter and the CPU keep the shape's loops (results never depend on them: the test above)."""
    from optstate_core.step import fused_launch
    cuda = torch.device("cuda", 0)
    monkeypatch.setitem(fused_launch._SMS, cuda, 132)
    assert fused_launch.loops_for(3_700_000, 1, 16, 1, cuda) == 16  # 0.95B parameters in one 4-bit launch
    assert fused_launch.loops_for(16384, 1, 16, 1, cuda) == 2  # one 2048 x 2048 matrix: 8192 programs
    assert fused_launch.loops_for(16384, 4, 2, 2, cuda) == 1  # the same in int8: 4096 programs
    assert fused_launch.loops_for(8, 1, 16, 1, cuda) == 1
    assert fused_launch.loops_for(16384, 1, 16, 1, torch.device("cpu")) == 16


@pytest.mark.parametrize("kw", [dict(lr=1e-3), dict(lr=1e-3, betas=(0.95, 0.98), weight_decay=0.1),
                                dict(lr=1e-3, weight_decay=1.0, decoupled_weight_decay=True)],
                         ids=["plain", "betas-wd", "decoupled-wd"])
@pytest.mark.parametrize("codec", ["int8", "int4", "bf16"])
def test_lion_matches_reference(kw, codec):
    """lion-pytorch's Lion: the fused kernel against decode -> Lion -> encode, first step and later."""
    lion = pytest.importorskip("lion_pytorch").Lion
    pol = lambda: oc.WarmupPolicy(warmup_steps=0, momentum_codec=codec, min_int8_elements=0,
                                  whole_blocks_1d=False)  # noqa: E731
    run_pair(lion, kw, pol)
    run_pair(lion, kw, pol, steps_before=0)


def _schedule_free_pair(v_codec, z_codec, steps, warmup_steps=2, weight_decay=0.1):
    """Schedule-free AdamW wrapped with the reference path and with the kernel, from the same
    weights and gradients; returns both optimizers and parameter lists."""
    sf = pytest.importorskip("schedulefree").AdamWScheduleFree
    runs = []
    for fused in (False, True):
        ps = params()
        pol = oc.WarmupPolicy(warmup_steps=0, variance_codec=v_codec, iterate_codec=z_codec, min_int8_elements=0,
                              whole_blocks_1d=False)
        opt = oc.wrap(sf(ps, lr=1e-2, warmup_steps=warmup_steps, weight_decay=weight_decay), pol, fused=fused)
        opt.train()
        for s in range(steps):
            set_grads(ps, s)
            opt.step()
            if fused:
                assert opt.last_step_timings["fused_params"] == len(SHAPES)
        runs.append((opt, ps))
    return runs


@pytest.mark.parametrize("v_codec,z_codec", [("int8", "fp32"), ("int4", "fp32"), ("int8", "fp24"), ("bf16", "bf16")],
                         ids=["int8-z32", "int4-z32", "int8-z24", "bf16-zbf16"])
def test_schedule_free_adamw_matches_reference(v_codec, z_codec):
    """schedulefree's AdamWScheduleFree (train mode, warmup, decay): the kernel against decode ->
    AdamWScheduleFree.step -> encode over three steps (first included). Stated bound: parameters and
    the decoded z within 1e-5 relative + 1e-6 (fp24 z: 4e-5, one residual step of 2**-15 where fp32
    round-off moves a value across a rounding boundary, seen on an H100); the group values (k,
    lr_max, weight_sum) equal."""
    (ref, ref_ps), (opt, ps) = _schedule_free_pair(v_codec, z_codec, steps=3)
    close = 4e-5 if z_codec == "fp24" else 1e-5
    for rp, p in zip(ref_ps, ps):
        torch.testing.assert_close(p, rp, rtol=close, atol=1e-6)
        for key in ("z", "exp_avg_sq"):
            a, b = ref.get_state(rp)[key], opt.get_state(p)[key]
            tol = close if key == "z" else 0.02  # v: one code step of its codec at most
            torch.testing.assert_close(b, a, rtol=tol, atol=tol * float(a.abs().max()))
    for key in ("k", "lr_max", "weight_sum", "scheduled_lr"):
        assert ref.param_groups[0][key] == opt.param_groups[0][key]
    assert ref.param_groups[0]["k"] == 3


def test_schedule_free_eval_and_train_after_fused_steps():
    """eval()/train() on fused state (fp24 z) move the parameters to x and back to y."""
    (_, _), (opt, ps) = _schedule_free_pair("int8", "fp24", steps=2)
    y = [p.detach().clone() for p in ps]
    opt.eval()
    assert not all(torch.equal(a, b) for a, b in zip(y, ps))
    opt.train()
    for a, b in zip(y, ps):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def test_schedule_free_fused_steps_reuse_their_plan():
    """After its first (allocating) step, the fused schedule-free step launches the buckets it
    planned before, while no state or gradient changed form; group values still advance."""
    (_, _), (opt, ps) = _schedule_free_pair("int8", "fp32", steps=2)
    engine = opt._engine
    buckets = engine._plan_cache[1]
    set_grads(ps, 5)
    opt.step()
    assert engine._plan_cache[1] is buckets and opt.last_step_timings["fused_params"] == len(SHAPES)
    assert opt.param_groups[0]["k"] == 3
