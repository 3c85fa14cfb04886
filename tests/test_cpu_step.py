"""The CPU fast path (cpu_step.py) against the tiled reference step it replaces."""
import logging

import pytest
import torch

import optstate_core as oc
from optstate_core.step import cpu_compile, cpu_step

# 1-D, rows of whole 256-blocks, rows shorter than a block, odd and ragged widths
SHAPES = [(512,), (64, 512), (48, 128), (9, 300), (5, 1001)]


def run(preset, *, fast, steps=4, inner=None, shapes=SHAPES, chunk_bytes=None, grads=None, wd=(0.1, 0.0), **policy):
    """Train random parameters a few steps with the fast path on or off (eager unless the test
    turns compilation on); returns the params and the wrapped optimizer."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s) * 0.02) for s in shapes]
    groups = [{"params": params[::2], "weight_decay": wd[0]}, {"params": params[1::2], "weight_decay": wd[1]}]
    opt_inner = (inner or (lambda g: torch.optim.AdamW(g, lr=1e-2, betas=(0.9, 0.95))))(groups)
    options = {} if chunk_bytes is None else {"chunk_bytes": chunk_bytes}
    opt = oc.wrap(opt_inner, oc.make_policy(preset, **{"min_int8_elements": 0, **policy}),
                  tuning={"cpu_fast_path": fast}, **options)
    gen = torch.Generator().manual_seed(1)
    for i in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen) * 1e-3
        if grads is not None:
            grads(i, params)
        opt.step()
    return params, opt


def payloads(opt, p):
    return {(k, n): t for k in ("exp_avg", "exp_avg_sq") for n, t in opt.state[p][k].payload.items()}


@pytest.mark.parametrize("preset", ["8bit", "4bit", "bf16"])
def test_eager_fast_path_is_bit_identical_to_the_tiled_reference(preset):
    ref_params, ref = run(preset, fast=False)
    params, opt = run(preset, fast=True)
    assert opt.last_step_timings["materialize_ms"] == 0  # the last step never went through tiles
    assert opt._engine._plan_cache is not None  # steps 3 and 4 ran from the cached plan
    for a, b in zip(ref_params, params):
        assert torch.equal(a, b)
        assert torch.equal(ref.state[a]["step"], opt.state[b]["step"])
        for key, t in payloads(ref, a).items():
            assert torch.equal(t, payloads(opt, b)[key]), key


def test_adam_with_l2_decay_and_sgd_keep_the_reference_path():
    for inner in (lambda g: torch.optim.Adam(g, lr=1e-2), lambda g: torch.optim.SGD(g, lr=0.1, momentum=0.9)):
        params, opt = run("8bit", fast=True, steps=2, inner=inner)
        assert opt.last_step_timings["materialize_ms"] > 0


def test_switch_off_by_environment():
    _, opt = run("8bit", fast=False, steps=2)
    assert opt.last_step_timings["materialize_ms"] > 0


def test_maximize_and_adam_without_decay_match_the_reference():
    for inner in (lambda g: torch.optim.AdamW(g, lr=1e-2, maximize=True),
                  lambda g: torch.optim.Adam(g, lr=1e-2, weight_decay=0.0)):
        ref_params, _ = run("8bit", fast=False, steps=3, inner=inner, wd=(0.0, 0.0))
        params, opt = run("8bit", fast=True, steps=3, inner=inner, wd=(0.0, 0.0))
        assert opt.last_step_timings["materialize_ms"] == 0
        for a, b in zip(ref_params, params):
            assert torch.equal(a, b)


def test_decoded_state_stays_under_chunk_bytes():
    shapes = [(64, 512)]
    ref_params, ref = run("8bit", fast=False, steps=3, shapes=shapes, chunk_bytes=16 * 512 * 8)
    params, opt = run("8bit", fast=True, steps=3, shapes=shapes, chunk_bytes=16 * 512 * 8)
    m = opt.last_step_timings
    assert m["materialize_ms"] == 0 and m["tiles"] == 4
    assert m["peak_materialized_bytes"] == 16 * 512 * 8
    assert torch.equal(ref_params[0], params[0])
    # a row larger than the chunk (the fast path views 512-wide rows as 256-wide ones: 2 KiB of
    # decoded state): the tiled path, which can cut inside rows
    _, opt = run("8bit", fast=True, steps=2, shapes=shapes, chunk_bytes=1024)
    assert opt.last_step_timings["materialize_ms"] > 0


def test_nonfinite_gradient_still_skips_the_parameter():
    def poison(step, params):
        if step == 2:
            params[1].grad[3, 7] = float("nan")
    ref_params, ref = run("8bit", fast=False, steps=3, grads=poison)
    params, opt = run("8bit", fast=True, steps=3, grads=poison)
    assert opt.memory_report()["nonfinite_skipped"] == ref.memory_report()["nonfinite_skipped"] == 1
    assert int(opt.state[params[1]]["step"]) == 2 and int(opt.state[params[0]]["step"]) == 3
    for a, b in zip(ref_params, params):
        assert torch.equal(a, b)


def test_cached_plan_follows_group_options_and_nan_gradients():
    """Steps after the first fast one reuse the engine's cached plan. A group option that takes
    the group off this path (L2 weight decay on Adam), set between steps, sends it back to the
    tiled reference at once; a NaN gradient on a cached step still skips that parameter only."""
    def change(step, params):
        if step == 3:
            opt_groups[0]["weight_decay"] = 0.1  # Adam + L2: the reference path's job
        if step == 4:
            params[1].grad[3, 7] = float("nan")
    results = []
    for fast in (False, True):
        opt_groups = []

        def inner(groups):
            opt = torch.optim.Adam(groups, lr=1e-2)
            opt_groups.extend(opt.param_groups)
            return opt
        params, opt = run("8bit", fast=fast, steps=3, inner=inner, wd=(0.0, 0.0))
        if fast:
            assert opt._engine._plan_cache is not None and opt.last_step_timings["materialize_ms"] == 0
            step_tensor = opt.state[params[1]]["step"]
        gen = torch.Generator().manual_seed(7)
        for i in (3, 4):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen) * 1e-3
            change(i, params)
            opt.step()
            if fast and i == 3:
                assert opt.last_step_timings["materialize_ms"] > 0  # group 0 went to the tiled path
        results.append((params, opt))
    (ref_params, ref), (params, opt) = results
    assert opt.memory_report()["nonfinite_skipped"] == ref.memory_report()["nonfinite_skipped"] == 1
    assert int(opt.state[params[1]]["step"]) == 4 and int(opt.state[params[0]]["step"]) == 5  # one skip
    assert opt.state[params[1]]["step"] is step_tensor  # counted in place
    for a, b in zip(ref_params, params):
        assert torch.equal(a, b)


def test_failed_compilation_falls_back_to_the_eager_step(monkeypatch, caplog):
    def broken(fn, **kwargs):
        def call(*args):
            raise RuntimeError("no compiler here")
        return call
    monkeypatch.setenv("OPTSTATE_CPU_COMPILE", "1")
    monkeypatch.setattr(cpu_step.torch, "compile", broken)
    monkeypatch.setattr(cpu_step, "_STEPPERS", {})
    monkeypatch.setattr(cpu_step, "_FAILED", set())
    ref_params, _ = run("8bit", fast=False, steps=3)
    with caplog.at_level(logging.WARNING, logger="optstate"):
        params, opt = run("8bit", fast=True, steps=3)
    assert "torch.compile failed: no compiler here" in caplog.text
    for a, b in zip(ref_params, params):
        assert torch.equal(a, b)


# (shapes, distinct static widths allowed, slices a call, compile mode): two shapes viewed as
# 256-wide rows, stepped in one batch padded to four, compiled from the first call; two odd widths
# that share the graph with symbolic widths once no static width is left, one slice a call, in
# "auto" mode with (almost) no eager time to wait for: the first step eager, the later ones compiled
COMPILED_CASES = [([(32, 512), (16, 256)], cpu_step.MAX_STATIC_WIDTHS, "4", "1"),
                  ([(9, 300), (5, 1001)], 0, "1", "auto")]


@pytest.mark.parametrize("shapes,static_widths,batch,mode", COMPILED_CASES,
                         ids=["256-wide rows", "symbolic widths, eager then compiled"])
def test_compiled_step_matches_the_reference_within_its_bound(monkeypatch, shapes, static_widths, batch, mode):
    """Compiled code may round a few float operations differently from eager torch (inductor
    lowers lerp/addcmul without torch's fused multiply-add and divides by the bias correction
    through its reciprocal), so parameters may differ by a few ulp. Codes come from the same
    rounding stream and differ only where a value sits within those ulp of a threshold. A run
    that switches from eager to compiled mid-way stays within the same bound.

    Each case is one shape class: a single compilation for both shapes."""
    if not hasattr(torch, "compile"):
        pytest.skip("torch.compile unavailable")
    from torch._dynamo.utils import counters
    monkeypatch.setenv("OPTSTATE_CPU_COMPILE", mode)
    monkeypatch.setenv("OPTSTATE_CPU_COMPILE_AFTER", "1e-9")  # "auto": compiled once any eager time was spent
    monkeypatch.setenv("OPTSTATE_CPU_BATCH", batch)
    monkeypatch.setattr(cpu_step, "_STEPPERS", {})  # compile here, whatever ran before
    monkeypatch.setattr(cpu_step, "_EAGER_SECONDS", {})
    monkeypatch.setattr(cpu_step, "_STATIC_WIDTHS", {})
    monkeypatch.setattr(cpu_step, "MAX_STATIC_WIDTHS", static_widths)
    ref_params, ref = run("8bit", fast=False, steps=4, shapes=shapes)
    graphs = counters["stats"]["unique_graphs"]
    params, opt = run("8bit", fast=True, steps=4, shapes=shapes)
    compiled_graphs = counters["stats"]["unique_graphs"] - graphs
    assert bool(cpu_step._EAGER_SECONDS) == (mode == "auto")  # "auto" ran eagerly before compiling
    if any(flags[:2] == (opt.state[params[0]]["exp_avg"].codec, opt.state[params[0]]["exp_avg_sq"].codec)
           for flags in cpu_step._FAILED):
        pytest.skip("torch.compile failed on this machine (the eager fallback is tested above)")
    assert opt.last_step_timings["materialize_ms"] == 0
    assert compiled_graphs == 1
    codes, differing = 0, 0
    for a, b in zip(ref_params, params):
        ulps = (a - b).abs() / (torch.finfo(torch.float32).eps * (a.abs() + 1e-2))  # in ulp of |p| + lr
        assert (ulps <= 4).float().mean() >= 0.999  # a few ulp, except where a code flipped
        assert (a - b).abs().max() <= 1e-2  # and never more than one lr step
        for key, t in payloads(ref, a).items():
            if key[1] == "codes":
                codes += t.numel()
                differing += int((t != payloads(opt, b)[key]).sum())
    assert differing <= 1e-3 * codes


def test_auto_mode_runs_a_short_job_eagerly(monkeypatch):
    """With the default "auto" mode, a run whose eager time stays under OPTSTATE_CPU_COMPILE_AFTER
    never calls the compiler (bit-identical to the reference, as the eager path is)."""
    def refuse(fn, **kwargs):
        raise AssertionError("compiled although the run was short")
    monkeypatch.delenv("OPTSTATE_CPU_COMPILE")
    monkeypatch.setenv("OPTSTATE_CPU_COMPILE_AFTER", "3600")
    monkeypatch.setattr(cpu_step.torch, "compile", refuse)
    monkeypatch.setattr(cpu_step, "_STEPPERS", {})
    monkeypatch.setattr(cpu_step, "_EAGER_SECONDS", {})
    ref_params, _ = run("4bit", fast=False, steps=3)
    params, opt = run("4bit", fast=True, steps=3)
    assert opt.last_step_timings["materialize_ms"] == 0
    assert cpu_step._EAGER_SECONDS and all(t < 3600 for t in cpu_step._EAGER_SECONDS.values())
    assert all(torch.equal(a, b) for a, b in zip(ref_params, params))


@pytest.mark.parametrize("name,value", [("OPTSTATE_CPU_COMPILE", "yes"), ("OPTSTATE_CPU_COMPILE_AFTER", "-1"),
                                        ("OPTSTATE_CPU_COMPILE_AFTER", "soon"), ("OPTSTATE_CPU_BATCH", "0")])
def test_a_bad_cpu_setting_is_refused_at_wrap(monkeypatch, name, value):
    """A bad CPU setting (read at wrap(), the default of a ``tuning`` field) is refused there with its
    name, before the inner optimizer is touched: its state stays empty and it trains as before."""
    params = [torch.nn.Parameter(torch.randn(64, 512) * 0.02)]
    inner = torch.optim.AdamW(params, lr=1e-2)
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=name):
        oc.wrap(inner, "8bit")
    assert not inner.state and inner.param_groups[0]["params"] == params
    monkeypatch.delenv(name)
    opt = oc.wrap(inner, "8bit")
    params[0].grad = torch.ones_like(params[0])
    opt.step()
    assert int(opt.state[params[0]]["step"]) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_cpu_finite_flags_match_the_infinity_norm(dtype):
    from optstate_core.step.gradients import GRAD_OVERFLOW, finite_flags
    grads = [torch.randn(40, 70, dtype=dtype) for _ in range(6)] + [torch.full((3,), 1e30, dtype=torch.float64),
                                                                     torch.full((3,), -1e18, dtype=torch.float64)]
    grads[1][3, 4] = float("nan")
    grads[3][0, 0] = float("inf")
    grads[4][9, 9] = -float("inf")
    expected = [bool((torch.linalg.vector_norm(g.double(), float("inf")) < GRAD_OVERFLOW).item()) for g in grads]
    assert expected == [True, False, True, False, False, True, False, True]
    assert finite_flags(grads).tolist() == expected


@pytest.mark.parametrize("n", [15, 100])
def test_bucketize_by_counting_is_torch_bucketize(n):
    x = torch.randn(4000)
    x[::97], x[::89], x[::83] = float("nan"), float("inf"), -float("inf")
    bounds = torch.sort(torch.randn(n)).values
    x[:n] = bounds  # ties
    for right in (False, True):
        for out_int32 in (False, True):
            expected = torch.bucketize(x, bounds, right=right, out_int32=out_int32)
            got = cpu_compile.bucketize_by_counting(x, bounds, right=right, out_int32=out_int32)
            assert got.dtype == expected.dtype and torch.equal(got, expected)


def test_each_stepper_has_its_own_code_object(monkeypatch):
    """dynamo counts its recompile limit (8) per code object: steppers for different codec pairs
    and widths must not share one, or a model with many would silently fall back to eager."""
    from optstate_core.state.codecs.int8 import Int8Codec
    monkeypatch.setattr(cpu_step, "_STEPPERS", {})
    m, v = Int8Codec().specialize(False), Int8Codec().specialize(True)
    steppers = [cpu_step._stepper(m, v, maximize, narrow, width, compiled=False, batch=batch)
                for maximize in (False, True) for narrow in (False, True) for width in (128, 256, 300, 1001, None)
                for batch in (1, 4)]
    assert len({id(f.__code__) for f in steppers}) == len(steppers)


def test_batches_respect_the_batch_size_and_chunk_bytes():
    parts = [cpu_step._Slice(None, None, {}, {}, [], [], n) for n in (10, 10, 10, 10, 10, 35, 10, 40, 5)]
    sizes = [[s.nbytes for s in b] for b in cpu_step._batches(parts, 40, 4)]
    assert sizes == [[10, 10, 10, 10], [10], [35], [10], [40], [5]]
    assert [len(b) for b in cpu_step._batches(parts, 10 ** 6, 4)] == [4, 4, 1]


def test_batch_size_from_the_environment(monkeypatch):
    from optstate_core.tuning import Tuning
    assert Tuning.from_env({"OPTSTATE_CPU_BATCH": "2"}).cpu_batch == 2
    for bad in ("0", "-1", "x", "1.5"):
        with pytest.raises(ValueError, match="OPTSTATE_CPU_BATCH"):
            Tuning.from_env({"OPTSTATE_CPU_BATCH": bad})
    monkeypatch.setenv("OPTSTATE_CPU_BATCH", "2")
    params = [torch.nn.Parameter(torch.zeros(4, 256))]
    assert oc.wrap(torch.optim.AdamW(params), "8bit").options.tuning.cpu_batch == 2
    assert oc.wrap(torch.optim.AdamW(params), "8bit", tuning={"cpu_batch": 3}).options.tuning.cpu_batch == 3


@pytest.mark.parametrize("size", [3, 16])
def test_eager_batches_of_any_size_are_bit_identical(monkeypatch, size):
    monkeypatch.setenv("OPTSTATE_CPU_BATCH", str(size))
    ref_params, ref = run("4bit", fast=False)
    params, opt = run("4bit", fast=True)
    for a, b in zip(ref_params, params):
        assert torch.equal(a, b)
        for key, t in payloads(ref, a).items():
            assert torch.equal(t, payloads(opt, b)[key]), key


@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_codecs_take_slices_of_no_rows(codec):
    """The compiled step pads a short batch with empty slices: every codec op must accept 0 rows."""
    from optstate_core.state.codecs import get_codec
    c = get_codec(codec).specialize(True)
    empty = torch.zeros(0, 256)
    enc = c.encode(empty)
    assert enc.decode().shape == (0, 256)
