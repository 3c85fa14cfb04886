"""Offload and paging on the CPU: the host tier is ordinary memory and streams are no-ops, but the
tier logic, the budget, the staging ring and its ordering code all run.

Both the reference path (tiles) and the fused path (Triton kernels under TRITON_INTERPRET) are
checked: resident, budgeted and fully offloaded runs give bit-identical results.
"""
import gc
import io
import weakref

import pytest
import torch

import optstate_core as oc
from helpers import flat_params

SHAPES = [(64, 256), (32, 256), (512,), (16, 512)]
# The fused path runs the real kernels where there is a GPU (streams, pinned host rows, events),
# the interpreted ones on the CPU.
FUSED_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def model_params(seed=0, shapes=SHAPES, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter((torch.randn(s, generator=g) * 0.1).to(device)) for s in shapes]


def set_grads(ps, step):
    g = torch.Generator().manual_seed(100 + step)
    for p in ps:
        p.grad = (torch.randn(p.shape, generator=g) * 0.01).to(p.device)


def policy(preset):
    if preset == "8bit-sr":  # stochastic rounding: counters must follow elements across row pieces
        return oc.make_policy("8bit", min_int8_elements=0,
                              whole_blocks_1d=False, momentum_codec=oc.Int8Codec(stochastic_rounding=True))
    return oc.make_policy(preset, min_int8_elements=0, whole_blocks_1d=False)


def run(fused, steps=4, preset="8bit", shapes=SHAPES, **options):
    ps = model_params(shapes=shapes, device=FUSED_DEVICE if fused else "cpu")
    opt = oc.wrap(torch.optim.AdamW(ps, lr=1e-2), policy(preset), fused=fused, **options)
    for s in range(steps):
        set_grads(ps, s)
        opt.step()
    return ps, opt


MODES = {
    "resident": {},
    # room for the first tensor's int8 state (33 280 B) beside a ring of half the budget; the rest streams
    "budgeted": dict(gpu_budget=67560, staging_bytes="64KB"),
    # several chunks through a small ring; the first tensor is split into row pieces
    "offloaded": dict(offload=True, staging_bytes="40KB"),
}


@pytest.mark.parametrize("fused", [False, True], ids=["reference", "fused"])
@pytest.mark.parametrize("preset", ["8bit", "4bit", "8bit-sr"])
def test_resident_budgeted_offloaded_identical(fused, preset):
    results = {}
    for mode, options in MODES.items():
        ps, opt = run(fused, preset=preset, **options)
        results[mode] = flat_params(ps)
        report = opt.memory_report()
        if mode == "resident":
            assert report["host_bytes"] == 0
        elif mode == "offloaded":
            assert report["device_bytes"] == 0 and report["host_bytes"] > 0
        else:
            assert report["device_bytes"] > 0 and report["host_bytes"] > 0
        if fused:
            assert opt.last_step_timings["fused_params"] == len(SHAPES)
            if mode != "resident":
                moved = opt.last_step_timings
                assert moved["h2d_bytes"] > 0 and moved["h2d_bytes"] == moved["d2h_bytes"]
    assert torch.equal(results["resident"], results["budgeted"])
    assert torch.equal(results["resident"], results["offloaded"])


def test_budget_accounting():
    ps, opt = run(False, **MODES["budgeted"])
    engine = opt._engine
    resident = [p for p in ps if id(p) in engine.placement.resident]
    # 33 780 B of room for 70 656 B of int8/fp32 state (33 280, 16 640, 4 096, 16 640): the resident
    # share (48%) spread along the order: the first tensor's accrued share (15 900 B) is under half
    # of it, so it streams; the next two stay; the last no longer fits the room left
    assert resident == [ps[1], ps[2]]
    device_bytes = opt.memory_report()["device_bytes"]
    assert device_bytes + engine.placement.staging_size(ps[0].device) <= engine.placement.gpu_budget
    for p in (ps[0], ps[3]):
        assert opt.state[p]["exp_avg"].host_tier


def test_spread_residency():
    """The resident share spreads evenly along the parameters (every other one at half the
    state), rounding leftovers are filled in order, everything stays when it fits, nothing
    with no room."""
    from optstate_core.schedule.placement import spread_residency
    assert spread_residency([10] * 8, 40) == [True, False] * 4
    assert spread_residency([10] * 9, 30) == [False, True, False] * 3
    assert spread_residency([10, 10, 10, 2, 2], 11) == [False, True, False, False, False]
    assert spread_residency([30, 5, 5, 30], 40) == [True, True, True, False]  # the leftover filled in order
    assert spread_residency([3, 4], 7) == [True, True] and spread_residency([3, 4], 0) == [False, False]
    assert spread_residency([], 5) == []


@pytest.mark.parametrize("fused", [False, True], ids=["reference", "fused"])
def test_offload_reload_round_trip_is_exact(fused):
    ref_ps, ref = run(fused, steps=3)
    ps, opt = run(fused, steps=3)
    opt.offload()
    opt.offload()  # idempotent
    assert opt.memory_report()["device_bytes"] == 0
    assert all(v.host_tier for st in opt.state.values() for v in st.values() if isinstance(v, oc.EncodedTensor))
    for s in (3, 4):  # a step after offload() wakes the state first (docs/rl.md)
        set_grads(ps, s)
        set_grads(ref_ps, s)
        opt.step()
        ref.step()
    opt.reload()
    opt.reload()
    assert opt.memory_report()["host_bytes"] == 0
    for s in (5, 6):
        set_grads(ps, s)
        set_grads(ref_ps, s)
        opt.step()
        ref.step()
    assert torch.equal(flat_params(ps), flat_params(ref_ps))


@pytest.mark.parametrize("mode", ["resident", "budgeted", "offloaded", "offload()"])
def test_checkpoint_in_every_mode(mode):
    options = MODES.get(mode, {})
    ps, opt = run(True, steps=3, **options)
    if mode == "offload()":
        opt.offload()
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf, weights_only=True)
    set_grads(ps, 3)
    opt.step()
    expected = flat_params(ps)
    ps2 = model_params(device=FUSED_DEVICE)
    with torch.no_grad():
        for a, b in zip(ps2, run(True, steps=3, **options)[0]):
            a.copy_(b)
    opt2 = oc.wrap(torch.optim.AdamW(ps2, lr=1e-2), oc.make_policy("8bit", min_int8_elements=0,
                                                                   whole_blocks_1d=False), fused=True,
                   **MODES["resident"])
    opt2.load_state_dict(sd)
    set_grads(ps2, 3)
    opt2.step()
    assert torch.equal(flat_params(ps2), expected)


def test_prefetch_during_backward_only_on_steps():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 32), torch.nn.Tanh(), torch.nn.Linear(32, 256))
    twin = torch.nn.Sequential(torch.nn.Linear(256, 32), torch.nn.Tanh(), torch.nn.Linear(32, 256))
    twin.load_state_dict(model.state_dict())
    model, twin = model.to(FUSED_DEVICE), twin.to(FUSED_DEVICE)
    policy = lambda: oc.make_policy("8bit", min_int8_elements=0, whole_blocks_1d=False)  # noqa: E731
    opt = oc.wrap(torch.optim.AdamW(model.parameters()), policy(), fused=True, offload=True,
                  staging_bytes="1MB", prefetch_budget="auto")
    ref = oc.wrap(torch.optim.AdamW(twin.parameters()), policy(), fused=True, offload=True, staging_bytes="1MB",
                  prefetch_budget=0)  # the ring alone
    uploads = []
    path = opt._engine.schedule
    original = path.prefetch

    def counting(param):
        before = len(path.prefetched)
        original(param)
        uploads.append(len(path.prefetched) - before)

    path.prefetch = counting
    for step in range(4):
        for micro in range(2):  # accumulation over 2 micro-batches
            x = torch.randn(8, 256, generator=torch.Generator().manual_seed(10 * step + micro)).to(FUSED_DEVICE)
            opt.set_step_boundary(micro == 1)
            model(x).square().mean().backward()
            twin(x).square().mean().backward()
        uploads.append("step")
        opt.step()
        ref.step()
        opt.zero_grad()
        ref.zero_grad()
    assert torch.equal(flat_params(model), flat_params(twin))
    # prefetch needs a cached plan (from the second step on) and only happens on the last micro-batch
    windows = " ".join(str(u) for u in uploads).split("step")
    assert all(set(w.split()) <= {"0"} for w in windows[:2])
    # staged (in slabs) during backward; on a GPU "auto" measures its budget in window 2 first
    assert any(sum(map(int, w.split())) > 0 for w in windows[2:4])
    assert not path.prefetched  # all consumed by the steps


def test_close_frees_everything():
    refs = []
    for _ in range(10):
        ps, opt = run(True, steps=2, offload=True, staging_bytes="40KB", shapes=[(8, 256), (256,)])
        refs.append(weakref.ref(opt._engine))
        opt.close()
        assert len(opt.state) == 0 and opt._engine.schedule._ring is None
        del opt, ps
    gc.collect()
    assert all(r() is None for r in refs)


def test_invalid_offload_options():
    ps = model_params()
    for kwargs, match in [(dict(gpu_budget=1.5), "gpu_budget"), (dict(gpu_budget="lots"), "gpu_budget"),
                          (dict(offload="yes"), "offload"), (dict(staging_bytes=0), "staging_bytes"),
                          (dict(prefetch_during_backward=1), "prefetch_during_backward")]:
        with pytest.raises(ValueError, match=match):
            oc.wrap(torch.optim.AdamW(ps), **kwargs)


def _master_weight_run(budget=None, steps=4):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 16), torch.nn.Tanh(), torch.nn.Linear(16, 256)).to(FUSED_DEVICE)
    oc.cast_model(model)  # bf16 weights; the correction is seeded with the bits they dropped
    options = {} if budget is None else dict(offload=True, staging_bytes="16KB", prefetch_budget=budget)
    opt = oc.wrap(torch.optim.AdamW(model.parameters(), lr=1e-2), oc.make_policy("bf16w-8bit", min_int8_elements=0,
                                                                                 whole_blocks_1d=False),
                  fused=True, **options)
    if budget is not None:  # stale bytes where the first step's state streams
        opt._engine.schedule.ring(torch.device(FUSED_DEVICE)).buffer.fill_(0x7F)
        if FUSED_DEVICE == "cuda":
            torch.cuda.synchronize()
    for s in range(steps):
        x = torch.randn(4, 256, generator=torch.Generator().manual_seed(s)).to(FUSED_DEVICE, torch.bfloat16)
        model(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad()
    return flat_params(model)


@pytest.mark.parametrize("budget", ["auto", 0], ids=["prefetch", "ring"])
def test_offloaded_master_weights_first_step_uploads_the_seeded_correction(budget):
    """The first fused step of offloaded master weights reads the correction cast_model seeded (it
    is not fresh state like the moments): it is uploaded, not taken from whatever the ring held."""
    assert torch.equal(_master_weight_run(budget), _master_weight_run())



def test_pinned_state_is_carved_from_whole_slabs():
    """Offloaded state's pinned memory comes from slabs of one power-of-two size (torch rounds every
    pinned request up to a power of two): views lie inside one slab, aligned, never overlapping; a
    request larger than a slab gets its own; allocate_many draws every view from the arena."""
    from optstate_core.state.codecs import codec_from_config
    from optstate_core.state.pinned import PinnedArena, pinning_totals
    from optstate_core.state.store import allocate_many
    arena = PinnedArena(slab_bytes=256, pin=False)
    bytes_before, seconds_before = pinning_totals()
    views = [arena.take(n, torch.float32, (n,)) for n in (5, 30, 7, 20, 100, 3)]
    assert arena.slabs_allocated == 3  # [5, 30, 7, 3] and [20] in slabs of 256 B (first fit); 100 floats (400 B) alone
    bytes_after, seconds_after = pinning_totals()  # what the example reports as the first step's pinning
    assert bytes_after - bytes_before == 256 + 400 + 256 and seconds_after >= seconds_before
    spans = []
    for v in views:
        assert v.data_ptr() % 16 == 0
        base = v.untyped_storage().data_ptr()
        spans.append((base, v.data_ptr() - base, v.data_ptr() - base + v.numel() * 4))
        assert spans[-1][2] <= max(256, v.numel() * 4)
    spans.sort()
    assert all(a[0] != b[0] or a[2] <= b[1] for a, b in zip(spans, spans[1:]))
    for i, v in enumerate(views):
        v.fill_(i)
    assert all(bool((v == i).all()) for i, v in enumerate(views))  # no view wrote over another
    codec = codec_from_config({"name": "int8"})
    out = allocate_many(codec, [(4, 8), (3, 8)], torch.float32, torch.device("cpu"), host=True, pin_memory=True,
                        arena=arena)
    for st in out:
        for t in st.payload.values():
            assert t.untyped_storage().nbytes() == 256  # a slab of the arena


def test_slow_pinning_names_the_allocator_setting_once(monkeypatch, caplog):
    """Offloaded state is pinned in the first step: where that runs under 3 GB/s over 4 GiB, one log line
    names torch's faster pinning setting; not again, and not where the setting is already made."""
    import logging
    from optstate_core.state import pinned
    monkeypatch.setattr(pinned, "_HINTED", [])
    monkeypatch.setattr(pinned, "_TOTALS", {"bytes": 8 * 2**30, "seconds": 0.0, "pinning_seconds": 8.0})  # 1.07 GB/s
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    with caplog.at_level(logging.INFO, logger="optstate.pinned"):
        pinned._hint_if_slow()
        pinned._hint_if_slow()
    hints = [r.getMessage() for r in caplog.records if r.name == "optstate.pinned"]
    assert len(hints) == 1 and pinned.FAST_PINNING in hints[0] and "1.1 GB/s" in hints[0]
    caplog.clear()
    monkeypatch.setattr(pinned, "_HINTED", [])
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", pinned.FAST_PINNING)
    with caplog.at_level(logging.INFO, logger="optstate.pinned"):
        pinned._hint_if_slow()
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    monkeypatch.setattr(pinned, "_TOTALS", {"bytes": 8 * 2**30, "seconds": 0.0, "pinning_seconds": 1.0})  # 8.6 GB/s
    with caplog.at_level(logging.INFO, logger="optstate.pinned"):
        pinned._hint_if_slow()
    assert not [r for r in caplog.records if r.name == "optstate.pinned"]
