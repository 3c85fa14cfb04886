"""Offloaded state pinned ahead of the first step (schedule/pin_ahead.py, state/pinned.py's PinAhead).

wrap() predicts the pinned allocations the first step will ask for and pins them on a thread; the
step takes them as it asks. The prediction must match what the step asks for, size for size, and
the trajectory must not change.
"""
import collections
import threading

import pytest
import torch

import optstate_core as oc
from optstate_core.schedule import pin_ahead
from optstate_core.state import pinned
from optstate_core.state.master_weights import cast_model
from optstate_core.state.pinned import PinAhead

from helpers import recording_arena, use_arena

pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = [(16, 256), (300,), (4, 512), (8, 384)]


def test_pin_ahead_hands_over_planned_sizes_and_drops_the_rest():
    ahead = PinAhead([32, 64, 32, 48], pin=False)
    ahead.wait()
    assert ahead.pinned_bytes == 176
    firsts = [ahead.take(32), ahead.take(32)]
    assert all(t is not None and t.numel() == 32 for t in firsts) and firsts[0].data_ptr() != firsts[1].data_ptr()
    assert ahead.take(32) is None and ahead.take(16) is None  # not planned, or all taken
    assert ahead.take(64).numel() == 64
    assert ahead.close() == 48 and ahead.taken == 3


def test_take_waits_for_its_size_being_pinned_and_strikes_off_one_not_started(monkeypatch):
    """While the thread pins 16 bytes: a 32-byte request strikes the planned 32 off (the caller pins
    it) instead of waiting behind the 16; a 16-byte request waits for the one being pinned."""
    gate, started = threading.Event(), threading.Event()
    real = pinned._pin

    def slow(n, pin):
        if n == 16:
            started.set()
            assert gate.wait(10)
        return real(n, pin)
    monkeypatch.setattr(pinned, "_pin", slow)
    ahead = PinAhead([16, 32], pin=False)
    assert started.wait(10)
    assert ahead.take(32) is None  # struck off: the thread will not pin it
    threading.Timer(0.05, gate.set).start()
    got = ahead.take(16)  # waits for the one being pinned
    assert got is not None and got.numel() == 16
    ahead.wait()
    assert ahead.pinned_bytes == 16 and ahead.close() == 0


def test_a_failing_thread_leaves_the_caller_to_pin(monkeypatch):
    def broken(n, pin):
        raise RuntimeError("no pinned memory")
    monkeypatch.setattr(pinned, "_pin", broken)
    ahead = PinAhead([16, 16], pin=False)
    ahead.wait()
    assert isinstance(ahead.error, RuntimeError) and ahead.take(16) is None and ahead.close() == 0


def _params():
    g = torch.Generator().manual_seed(0)
    ps = torch.nn.ParameterList([torch.nn.Parameter((torch.randn(s, generator=g) * 0.5).to(DEVICE))
                                 for s in SHAPES])
    cast_model(ps)
    return list(ps)


def _record(opt, ahead: bool):
    """The suite has no CUDA: swap the engine's arena (and its failing pinned thread) for a
    recording arena (``helpers.recording_arena``), pinning the first step's predicted requests
    ahead with ``ahead``; returns the prediction and the pool (or None)."""
    engine = opt._engine
    use_arena(opt, recording_arena(engine.pinned.slab_bytes))  # tuning.pinned_slab_bytes
    predicted = pin_ahead.first_step_requests(engine)
    pool = engine.pinned.pin_ahead(predicted) if ahead else None
    if pool is not None:
        pool.wait()  # all pinned before the step asks: otherwise one not started yet is struck off
    return predicted, pool


def _grads(ps, s):
    g = torch.Generator().manual_seed(100 + s)
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g).to(DEVICE, torch.bfloat16)


def _run(preset, ahead: bool, monkeypatch, steps=2, **options):
    monkeypatch.setenv("OPTSTATE_PIN_AHEAD", "1" if ahead else "0")
    ps = _params()
    opt = oc.wrap(torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1), preset, fused=True, release_gradients=True,
                  pin_memory=True, staging_bytes="64KB", **options)
    engine = opt._engine
    assert (engine.pinned.ahead is not None) == ahead  # wrap() started it (with CUDA's pinned memory)
    predicted, pool = _record(opt, ahead)
    for s in range(steps):
        _grads(ps, s)
        for p in reversed(ps):  # the post-accumulate-grad hooks, in backward order
            engine.schedule.gradient_ready(p)
        opt.step()
        assert engine.pinned.ahead is None  # ended with the first step
    return ps, opt, predicted, engine.pinned.asked, pool


@pytest.mark.parametrize("slab_bytes", ["0", "256", None], ids=["own", "small-slabs", "default-slabs"])
@pytest.mark.parametrize("preset,options", [("bf16w-4bit-lean-offload", {}),
                                            ("bf16w-4bit-lean", {"gpu_budget": "24KB"})],
                         ids=["offload", "budget"])
def test_first_step_requests_are_what_the_first_step_pins(preset, options, slab_bytes, monkeypatch):
    """The prediction, size for size, is what the first step allocates in the arena (a budget keeps
    some parameters' state resident: theirs are not asked for), with an allocation per state or in
    shared slabs, all served from the pool; the parameters after two steps are bit for bit those
    without pinning ahead."""
    if slab_bytes is None:
        monkeypatch.delenv("OPTSTATE_PINNED_SLAB_BYTES", raising=False)
    else:
        monkeypatch.setenv("OPTSTATE_PINNED_SLAB_BYTES", slab_bytes)
    ps0, _, _, _, _ = _run(preset, False, monkeypatch, **options)
    ps1, opt, predicted, asked, pool = _run(preset, True, monkeypatch, **options)
    assert predicted and collections.Counter(asked) == collections.Counter(predicted)
    assert pool.taken == len(predicted) and pool.error is None
    total = sum(p.numel() for p in ps1)
    host = sum(p.numel() for p in ps1 if getattr(opt.state[p]["exp_avg"], "host_tier", False))
    assert (host == total) == (preset.endswith("offload")) and host > 0
    for p, q in zip(ps0, ps1):
        assert torch.equal(p, q)


def test_nothing_is_pinned_ahead_without_host_state_or_when_turned_off(monkeypatch):
    monkeypatch.setenv("OPTSTATE_PIN_AHEAD", "1")
    ps = _params()
    opt = oc.wrap(torch.optim.AdamW(ps, lr=1e-2), "bf16w-4bit-lean", fused=True, release_gradients=True,
                  pin_memory=True)
    assert pin_ahead.first_step_requests(opt._engine) == []  # every state resident
    monkeypatch.setenv("OPTSTATE_PIN_AHEAD", "2")
    with pytest.raises(ValueError, match="OPTSTATE_PIN_AHEAD"):
        oc.wrap(torch.optim.AdamW(_params(), lr=1e-2), "bf16w-4bit-lean-offload", fused=True, pin_memory=True)


def test_a_copy_made_before_the_first_step_pins_for_itself(monkeypatch):
    """deepcopy of a wrapped optimizer whose thread is pinning ahead: the copy carries no thread (it
    pins in its first step) and trains as the original."""
    import copy
    monkeypatch.setenv("OPTSTATE_PIN_AHEAD", "1")
    ps = _params()  # cast_model's remainders go with the copy (test_master_weights)
    opt = oc.wrap(torch.optim.AdamW(ps, lr=1e-2), "bf16w-4bit-lean-offload", fused=True, pin_memory=True,
                  staging_bytes="64KB")
    assert opt._engine.pinned.ahead is not None
    qs, opt2 = copy.deepcopy((ps, opt))
    assert opt2._engine.pinned.ahead is None
    for params, optimizer in ((ps, opt), (qs, opt2)):
        _record(optimizer, False)
        _grads(params, 0)
        optimizer.step()
    for p, q in zip(ps, qs):
        assert torch.equal(p, q)


def test_state_loaded_before_the_first_step_trains_as_without_pinning_ahead(monkeypatch):
    """A checkpoint loaded between wrap() and the first step (a resumed run): whatever it allocates
    may come from the pool, the rest is dropped after the step; the run equals one that never
    pinned ahead."""
    import copy
    src = _params()
    donor = oc.wrap(torch.optim.AdamW(src, lr=1e-2), "bf16w-4bit-lean-offload", fused=True)
    _grads(src, 0)
    donor.step()
    saved = donor.state_dict()
    out = []
    for ahead in ("1", "0"):
        monkeypatch.setenv("OPTSTATE_PIN_AHEAD", ahead)
        ps = [torch.nn.Parameter(p.detach().clone()) for p in src]
        opt = oc.wrap(torch.optim.AdamW(ps, lr=1e-2), "bf16w-4bit-lean-offload", fused=True, pin_memory=True,
                      staging_bytes="64KB")
        engine = opt._engine
        _record(opt, ahead == "1")
        opt.load_state_dict(copy.deepcopy(saved))  # (as torch's, loading may adopt the tensors it is given)
        for s in (1, 2):
            _grads(ps, s)
            opt.step()
        assert engine.pinned.ahead is None and engine.step_count == 3  # one loaded, two here
        out.append(ps)
    for p, q in zip(*out):
        assert torch.equal(p, q)
