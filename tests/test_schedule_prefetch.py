"""Backward-time prefetch of offloaded state (schedule.py + prefetch.py) on the CPU.

The post-accumulate-grad hooks stage each parameter's offloaded state during backward (on the
CPU the "device" is host memory and the copies are plain copies, but the hooks, the budget, the
consumption in step(), the write-backs and every drop path run). Each scenario trains a twin
model with resident state and compares parameters and every state payload bit for bit after
each step. The fused kernels run under TRITON_INTERPRET=1 (conftest), on small tensors.
"""
import io
import os

import pytest
import torch

import optstate_core as oc
from helpers import flat_params

# CPU tensors reach the fused kernels (and so the schedule) only under TRITON_INTERPRET; on a GPU
# machine tests/gpu/test_prefetch_cuda.py runs the same path on CUDA.
pytestmark = pytest.mark.skipif(torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                                reason="CPU tensors take the fused path only under TRITON_INTERPRET")

STEPS = 20


class Tiny(torch.nn.Module):
    """Two 8x256 weights: one launch per step (the interpreter is slow), two parameters to stage."""

    def __init__(self):
        super().__init__()
        self.w1 = torch.nn.Parameter(torch.randn(8, 256) * 0.1)
        self.w2 = torch.nn.Parameter(torch.randn(8, 256) * 0.1)

    def forward(self, x):
        return torch.tanh(x @ self.w1.T) @ self.w2


def make_model(seed=0):
    torch.manual_seed(seed)
    return Tiny()


def make_opt(model, **options):
    policy = oc.make_policy("8bit", min_int8_elements=0, whole_blocks_1d=False)
    return oc.wrap(torch.optim.AdamW(model.parameters(), lr=1e-2), policy, fused=True, **options)


def batch(step, micro=0):
    return torch.randn(4, 256, generator=torch.Generator().manual_seed(1000 * step + micro))


def backward(model, x):
    model(x).square().mean().backward()


def assert_same_state(opt, ref):
    for (p, q) in zip(opt.param_groups[0]["params"], ref.param_groups[0]["params"]):
        a, b = opt.state[p], ref.state[q]
        assert a.keys() == b.keys()
        for key in a:
            x, y = a[key], b[key]
            if isinstance(x, oc.EncodedTensor):
                assert x.host_tier and not y.host_tier
                assert x.payload.keys() == y.payload.keys()
                for name in x.payload:
                    assert torch.equal(x.payload[name], y.payload[name]), (key, name)
            else:
                assert torch.equal(torch.as_tensor(x), torch.as_tensor(y)), key


def step_pair(opt, ref):
    """The scheduled optimizer and its resident twin step and clear their gradients."""
    for o in (opt, ref):
        o.step()
        o.zero_grad()


def twins(**options):
    model, twin = make_model(), make_model()
    twin.load_state_dict(model.state_dict())
    options.setdefault("prefetch_budget", "auto")
    return model, make_opt(model, offload=True, **options), twin, make_opt(twin)


def phase_bytes(opt):
    return opt.memory_report()["prefetch"]["bytes_by_phase"]


# a budget that stages some parameters during backward and streams the rest through the ring
SMALL_BUDGET = 6000  # one weight's int8 state (~4.2 kB), not both


@pytest.mark.parametrize("budget", ["auto", SMALL_BUDGET], ids=["everything", "partial"])
def test_scheduled_matches_resident_with_accumulation_and_clipping(budget):
    model, opt, twin, ref = twins(prefetch_budget=budget, staging_bytes="64KB")
    staged_steps = 0
    for step in range(STEPS):
        accumulate = 3 if step % 2 else 1
        for micro in range(accumulate):
            boundary = micro == accumulate - 1
            opt.set_step_boundary(boundary)
            backward(model, batch(step, micro))
            backward(twin, batch(step, micro))
            if not boundary:
                assert not opt._engine.schedule.prefetched  # uploads only on the boundary micro-batch
        if step % 3 == 0:  # clipping between backward and step changes gradients, not staged state
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
            torch.nn.utils.clip_grad_norm_(twin.parameters(), 0.01)
        staged_steps += bool(opt._engine.schedule.prefetched)
        step_pair(opt, ref)
        assert torch.equal(flat_params(model), flat_params(twin)), step
        assert_same_state(opt, ref)
        moved = opt.last_step_timings
        phases = phase_bytes(opt)
        assert phases["backward"] + phases["step"] == moved["h2d_bytes"]
        assert phases["behind_forward"] == moved["d2h_bytes"]
        if step >= 2:  # from the third step the plan is cached and the hooks stage state
            assert moved["h2d_bytes"] == moved["d2h_bytes"] > 0
            assert phases["backward"] > 0
            if budget == SMALL_BUDGET:
                assert phases["step"] > 0
                assert 0 < opt.memory_report()["prefetch"]["used_bytes_last_step"] <= SMALL_BUDGET
            else:
                assert phases["step"] == 0
    assert staged_steps >= STEPS - 2
    assert not opt._engine.schedule.prefetched


def test_everything_prefetched_moves_each_state_byte_once_per_direction():
    model, opt, twin, ref = twins()
    for step in range(4):
        backward(model, batch(step))
        opt.step()
        opt.zero_grad()
    state_bytes = opt.memory_report()["host_bytes"]
    phases = phase_bytes(opt)
    assert phases == {"backward": state_bytes, "step": 0, "behind_forward": state_bytes}
    assert opt.memory_report()["prefetch"]["used_bytes_last_step"] >= state_bytes


def test_nan_gradient_step_discards_staged_update():
    model, opt, twin, ref = twins()
    for step in range(8):
        backward(model, batch(step))
        backward(twin, batch(step))
        if step in (3, 6):
            for m in (model, twin):
                m.w1.grad[0, 0] = float("nan")
                m.w2.grad[5, 7] = float("inf")
        assert step < 2 or opt._engine.schedule.prefetched
        step_pair(opt, ref)
        assert torch.equal(flat_params(model), flat_params(twin)), step
        assert_same_state(opt, ref)
    assert opt._engine.nonfinite_skipped() == ref._engine.nonfinite_skipped() == 4


def test_zero_grad_or_skipped_step_drops_staged_state():
    model, opt, twin, ref = twins()
    for step in range(6):
        backward(model, batch(step))
        backward(twin, batch(step))
        if step == 3:  # e.g. a GradScaler that found inf: no step, zero_grad
            assert opt._engine.schedule.prefetched
            opt.zero_grad()
            ref.zero_grad()
            assert not opt._engine.schedule.prefetched
            continue
        step_pair(opt, ref)
    assert torch.equal(flat_params(model), flat_params(twin))
    assert_same_state(opt, ref)


def test_closure_step_prefetches_inside_step():
    model, opt, twin, ref = twins()
    for step in range(5):
        def closure(m=model, x=batch(step)):
            backward(m, x)
            return torch.tensor(0.0)
        opt.step(closure)
        backward(twin, batch(step))
        ref.step()
        opt.zero_grad()
        ref.zero_grad()
    assert phase_bytes(opt)["backward"] > 0
    assert torch.equal(flat_params(model), flat_params(twin))
    assert_same_state(opt, ref)


@pytest.mark.parametrize("when", ["after_backward", "mid_window"])
def test_checkpoint_with_staged_state_resumes_exactly(when):
    """A state_dict taken while state is staged (after the boundary backward, before step) or in
    the middle of an accumulation window: neither lost nor applied twice, in the original and
    in a fresh model/optimizer that resumes from it."""
    model, opt, twin, ref = twins()
    save_at = 4
    saved = None
    for step in range(8):
        for micro in range(2):
            opt.set_step_boundary(micro == 1)
            backward(model, batch(step, micro))
            backward(twin, batch(step, micro))
            if step == save_at and micro == (1 if when == "after_backward" else 0):
                assert bool(opt._engine.schedule.prefetched) == (when == "after_backward")
                saved = _save(model, opt)  # staged but not stepped, or in the middle of the window
        step_pair(opt, ref)
    assert torch.equal(flat_params(model), flat_params(twin))
    assert_same_state(opt, ref)

    model2 = make_model(seed=1)
    model_sd, opt_sd = saved
    model2.load_state_dict(model_sd)
    opt2 = make_opt(model2, offload=True, prefetch_budget="auto")
    opt2.load_state_dict(opt_sd)
    for step in range(save_at, 8):
        for micro in range(2):
            opt2.set_step_boundary(micro == 1)
            backward(model2, batch(step, micro))
        opt2.step()
        opt2.zero_grad()
    assert torch.equal(flat_params(model2), flat_params(twin))
    assert_same_state(opt2, ref)


def _save(model, opt):
    buf = io.BytesIO()
    torch.save((model.state_dict(), opt.state_dict()), buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def test_offload_reload_and_state_reads_with_staged_state():
    model, opt, twin, ref = twins()
    for step in range(7):
        backward(model, batch(step))
        backward(twin, batch(step))
        if step == 3:
            assert opt._engine.schedule.prefetched
            p = next(model.parameters())
            torch.testing.assert_close(opt.get_state(p)["exp_avg"], ref.get_state(next(twin.parameters()))["exp_avg"],
                                       rtol=0, atol=0)
            assert not opt._engine.schedule.prefetched  # a state read syncs and drops
        if step == 4:
            opt.offload()  # already offloaded: idempotent, drops the staged copies
            assert not opt._engine.schedule.prefetched
        step_pair(opt, ref)
    assert torch.equal(flat_params(model), flat_params(twin))
    assert_same_state(opt, ref)


def test_prefetch_budget_option():
    model = make_model()
    assert make_opt(model, offload=True)._engine.schedule.area.budget == "auto"  # on by default
    assert make_opt(model, offload=True, prefetch_during_backward=True)._engine.schedule.area.budget == "auto"
    assert make_opt(model, offload=True, prefetch_budget="auto")._engine.schedule.area.budget == "auto"
    assert make_opt(model, offload=True, prefetch_budget="1MB")._engine.schedule.area.budget == 10**6
    assert make_opt(model, offload=True, prefetch_budget=0)._engine.schedule.area.budget == 0
    assert make_opt(model, offload=True, prefetch_during_backward=False)._engine.schedule.area.budget == 0
    for kwargs, match in [(dict(prefetch_budget=-1), "prefetch_budget"), (dict(prefetch_budget="lots"), "prefetch_budget"),
                          (dict(prefetch_budget=True), "prefetch_budget"), (dict(prefetch_budget=1.5), "prefetch_budget"),
                          (dict(prefetch_budget=0, prefetch_during_backward=True), "prefetch_during_backward"),
                          (dict(prefetch_budget="1MB", prefetch_during_backward=False), "prefetch_during_backward"),
                          (dict(prefetch_during_backward="yes"), "prefetch_during_backward"),
                          (dict(release_gradients=True, prefetch_budget="1MB"), "prefetch_budget")]:
        before = [p.detach().clone() for p in model.parameters()]
        with pytest.raises(ValueError, match=match):
            make_opt(model, **kwargs)
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    released = make_opt(make_model(), release_gradients=True)  # auto: nothing to prefetch, no conflict
    assert released._engine.schedule.area.budget == 0


def test_prefetch_off_streams_in_step():
    model, opt, twin, ref = twins(prefetch_budget=0)
    for step in range(4):
        backward(model, batch(step))
        backward(twin, batch(step))
        assert not opt._engine.schedule.prefetched
        step_pair(opt, ref)
    phases = phase_bytes(opt)
    assert phases["backward"] == 0 and phases["step"] > 0
    assert not opt._engine.schedule._hooks
    assert torch.equal(flat_params(model), flat_params(twin))
    assert_same_state(opt, ref)


def test_e2e_bench_has_offloaded_rows_with_and_without_prefetch():
    from optstate_core.apps.e2e import e2e_configs

    configs, _ = e2e_configs(10**6, compare=False, budget_fraction=1 / 16)
    ps = [torch.nn.Parameter(torch.zeros(8, 256))]
    offloaded = {label: build(ps)._engine.schedule.area.enabled
                 for label, build in configs.items() if build is not None and ("offloaded" in label or "budget" in label)}
    assert offloaded and all(enabled == ("prefetch auto" in label) for label, enabled in offloaded.items())
    assert any("prefetch auto" in label for label in offloaded) and not all(offloaded.values())


def test_unmarked_accumulation_stops_backward_uploads():
    """Accumulation without set_step_boundary(): the second backward before a step drops the
    staged copies (they would sit through the window's forwards) and uploads move to step()."""
    model, opt, twin, ref = twins()
    schedule = opt._engine.schedule
    for step in range(6):
        for micro in range(2):
            backward(model, batch(step, micro))
            backward(twin, batch(step, micro))
            if step >= 2:
                assert bool(schedule.prefetched) == (step == 2 and micro == 0)
        step_pair(opt, ref)
    assert schedule.unmarked_accumulation and phase_bytes(opt)["backward"] == 0
    opt.set_step_boundary(True)  # marks arrive: uploads in backward again
    backward(model, batch(9))
    assert schedule.prefetched
    assert torch.equal(flat_params(model), flat_params(twin))
    assert_same_state(opt, ref)


def _slabs(opt):
    """The distinct slabs of the parameters staged so far in this window."""
    return {id(e.slab): e.slab for e in opt._engine.schedule.prefetched.values()}.values()


@pytest.mark.parametrize("slab_bytes", [None, 1], ids=["one-slab", "slab-per-parameter"])
def test_slabs_stage_several_parameters_in_merged_copies(slab_bytes, monkeypatch):
    """Backward stages the bucket's parameters in slabs: by default both weights share one slab
    whose copies merge adjacent host rows (fewer ranges than payload slots); with a tiny slab size
    each parameter gets its own. Either way the steps stay bit-identical to resident state."""
    from optstate_core.schedule import prefetch
    if slab_bytes is not None:
        monkeypatch.setattr(prefetch, "SLAB_BYTES", slab_bytes)
    model, opt, twin, ref = twins()
    for step in range(6):
        backward(model, batch(step))
        backward(twin, batch(step))
        if step >= 2:
            slabs = list(_slabs(opt))
            assert len(slabs) == (1 if slab_bytes is None else 2)
            if slab_bytes is None:
                plan = slabs[0].plan
                assert plan.indices == [0, 1]
                assert len(plan.ranges) < len(plan.layout.slots)
        step_pair(opt, ref)
        assert torch.equal(flat_params(model), flat_params(twin)), step
        assert_same_state(opt, ref)
        if step >= 2:
            assert phase_bytes(opt)["step"] == 0


def test_slab_not_filled_in_backward_uploads_in_step():
    """A bucket whose last gradient never reached its hook keeps its admitted parameters queued;
    step() uploads them first (counted as step-phase bytes) and the result is unchanged."""
    model, opt, twin, ref = twins()
    for step in range(5):
        if step < 3:
            backward(model, batch(step))
        else:  # gradients set directly; only w1's hook "runs"
            for m in (model, twin):
                gen = torch.Generator().manual_seed(step)
                m.w1.grad = torch.randn(8, 256, generator=gen) * 0.01
                m.w2.grad = torch.randn(8, 256, generator=gen) * 0.01
            opt._engine.schedule.prefetch(model.w1)
            assert not opt._engine.schedule.prefetched and opt._engine.schedule.area.queued_keys
        if step < 3:
            backward(twin, batch(step))
        step_pair(opt, ref)
        assert torch.equal(flat_params(model), flat_params(twin)), step
        assert_same_state(opt, ref)
        if step >= 3:
            phases = phase_bytes(opt)
            assert phases["backward"] == 0 and phases["step"] == phases["behind_forward"] > 0
            assert not opt._engine.schedule.area.queued_keys


def test_slab_plan_copies_whole_or_per_parameter():
    """A slab plan's merged copies move exactly the host payload bytes into the layout; copying
    one parameter's ranges leaves the other's region untouched."""
    from optstate_core.schedule.stage_plan import slab_plan
    model, opt, _, _ = twins()
    for step in range(3):
        backward(model, batch(step))
        opt.step()
        opt.zero_grad()
    (bucket,) = [b for b in opt._engine._plan_cache[1] if b.plan.offload]
    plan = slab_plan(bucket, [1, 0])
    for pieces in (None, [1]):
        buffer = torch.zeros(plan.layout.nbytes, dtype=torch.uint8)
        hosts, views, moved = plan.copies(buffer, pieces)
        for h, v in zip(hosts, views):
            v.copy_(h)
        staged = plan.layout.encoded(bucket, buffer, 0)
        expected = 0
        for j, i in enumerate(plan.indices):
            for k, enc in enumerate(bucket.storages[i]):
                for name, host in enc.payload.items():
                    if pieces is None or j in pieces:
                        assert torch.equal(staged[j][k].payload[name], host), (i, k, name)
                        expected += host.numel() * host.element_size()
                    else:
                        assert not staged[j][k].payload[name].view(torch.uint8).any()
        assert moved == expected


def test_a_bad_slab_size_setting_is_refused_by_name(monkeypatch):
    """``OPTSTATE_SLAB_MB`` is read at wrap() (not at import): it must be a positive integer,
    anything else is refused there with an error that names it; a valid one sets the slab size."""
    from optstate_core.schedule import prefetch
    monkeypatch.delenv("OPTSTATE_SLAB_MB", raising=False)
    assert make_opt(make_model())._engine.schedule.slab_bytes == prefetch.SLAB_BYTES == 64 << 20
    for value in ("abc", "0", "-4"):
        monkeypatch.setenv("OPTSTATE_SLAB_MB", value)
        with pytest.raises(ValueError, match="OPTSTATE_SLAB_MB must be a positive integer") as e:
            make_opt(make_model())
        assert repr(value) in str(e.value)
    monkeypatch.setenv("OPTSTATE_SLAB_MB", "32")
    assert make_opt(make_model())._engine.schedule.slab_bytes == 32 << 20
