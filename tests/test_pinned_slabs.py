"""Shared pinned slabs (state/pinned.py, off by default): their sizes, and states carved from them
save, load and resume as states with allocations of their own. The suite has no CUDA: the arena
hands out ordinary host memory (``pin=False``) through the same code."""
import io
import random

import pytest
import torch

import optstate_core as oc
from optstate_core.state import pinned
from optstate_core.state.pinned import PinnedArena

from helpers import mlp, recording_arena, train_steps, use_arena

pytest.importorskip("triton")


def test_a_slab_holds_one_dtype():
    """torch.save refuses a storage viewed as two dtypes: each dtype fills slabs of its own."""
    arena = PinnedArena(slab_bytes=4096, pin=False)
    a = arena.take(10, torch.uint8, (10,))
    b = arena.take(3, torch.float32, (3,))
    c = arena.take(5, torch.uint8, (5,))
    assert a.untyped_storage().data_ptr() == c.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
    assert c.data_ptr() - a.data_ptr() == 16  # 16-byte aligned views, one after the other
    assert arena.slabs_allocated == 2
    torch.load(io.BytesIO(_saved({"a": a, "b": b, "c": c})), weights_only=True)


def test_slabs_grow_from_small_to_the_largest_size_per_dtype(monkeypatch):
    """A dtype's first slab is MIN_SLAB_BYTES and each next one at least as large as all it was
    handed so far (a power of two), up to the largest slab; a larger request has its own
    allocation; by default the largest slab is SLAB_BYTES, with OPTSTATE_PINNED_SLAB_BYTES=0 every
    request has its own, the variable sets the largest slab, anything but an integer >= 0 is
    refused by name."""
    monkeypatch.delenv("OPTSTATE_PINNED_SLAB_BYTES", raising=False)
    monkeypatch.setattr(pinned, "MIN_SLAB_BYTES", 64)
    arena = PinnedArena(slab_bytes=1024, pin=False)
    sizes = []
    for _ in range(40):  # 32 floats = 128 B each
        t = arena.take(32, torch.float32, (32,))
        sizes.append(t.untyped_storage().nbytes())
    assert sorted(set(sizes)) == [128, 256, 512, 1024]  # 64 is too small for one request
    assert sizes[:4] == [128, 128, 256, 256] and sizes[-1] == 1024
    big = arena.take(300, torch.float32, (300,))
    assert big.untyped_storage().nbytes() == 1200 and arena.take(1, torch.int8, (1,)).untyped_storage().nbytes() == 64
    assert PinnedArena(pin=False).slab_bytes == pinned.SLAB_BYTES  # the default: shared slabs
    arena = PinnedArena(0, pin=False)
    a, b = arena.take(5, torch.float32, (5,)), arena.take(7, torch.float32, (7,))
    assert (a.untyped_storage().nbytes(), b.untyped_storage().nbytes()) == (32, 32)  # 16-byte padded, own

    def wrapped_slab_bytes(**options):  # the engine's arena and the park's, built from tuning.pinned_slab_bytes
        engine = oc.wrap(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(4))]), "8bit", **options)._engine
        assert engine.park_buffers.arena.slab_bytes == engine.pinned.slab_bytes
        return engine.pinned.slab_bytes
    assert wrapped_slab_bytes() == pinned.SLAB_BYTES
    monkeypatch.setenv("OPTSTATE_PINNED_SLAB_BYTES", "0")
    assert wrapped_slab_bytes() == 0
    assert wrapped_slab_bytes(tuning={"pinned_slab_bytes": "1MiB"}) == 2**20  # the option wins
    monkeypatch.setenv("OPTSTATE_PINNED_SLAB_BYTES", "256MB")
    with pytest.raises(ValueError, match="OPTSTATE_PINNED_SLAB_BYTES"):
        wrapped_slab_bytes()


def test_a_request_goes_to_the_oldest_slab_with_room():
    """First fit: a request too large for the end of a slab starts a new one and leaves that room to
    a later, smaller request (filled one slab at a time, 8B's offloaded state took 13% more)."""
    arena = PinnedArena(slab_bytes=1024, pin=False)
    a = arena.take(600, torch.uint8, (600,))
    b = arena.take(600, torch.uint8, (600,))
    c = arena.take(300, torch.uint8, (300,))
    d = arena.take(300, torch.uint8, (300,))
    same = lambda x, y: x.untyped_storage().data_ptr() == y.untyped_storage().data_ptr()  # noqa: E731
    assert same(a, c) and same(b, d) and not same(a, b) and arena.slabs_allocated == 2
    assert c.data_ptr() - a.data_ptr() == 608 and d.data_ptr() - b.data_ptr() == 608


@pytest.mark.parametrize("slab_bytes", [0, 256, 4096])
def test_predicted_allocations_are_those_take_makes(slab_bytes, monkeypatch):
    """PinnedArena.allocations (what pinning ahead pins) replays take()'s rule: for a random run of
    requests of three dtypes, from a fresh arena and from one part filled, the same sizes in order."""
    monkeypatch.setattr(pinned, "MIN_SLAB_BYTES", 64)
    rng = random.Random(slab_bytes)
    dtypes = (torch.uint8, torch.float32, torch.bfloat16)
    requests = [(rng.randint(1, 700), rng.choice(dtypes)) for _ in range(200)]
    for head in (0, 50):
        arena = recording_arena(slab_bytes)
        for numel, dtype in requests[:head]:
            arena.take(numel, dtype, (numel,))
        predicted = arena.allocations([(pinned.padded_bytes(n, d), d) for n, d in requests[head:]])
        arena.asked.clear()
        for numel, dtype in requests[head:]:
            arena.take(numel, dtype, (numel,))
        assert predicted == arena.asked and predicted


def _saved(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _build(preset, slab, options):
    model = mlp()
    if oc.presets.has_master_weights(preset):
        oc.cast_model(model)
    opt = oc.wrap(torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1), preset, fused=True,
                  pin_memory=True, staging_bytes="16KB", **options)
    use_arena(opt, PinnedArena(slab_bytes=slab, pin=False))
    return model, opt


@pytest.mark.parametrize("preset,options", [
    ("offload", {}),
    ("bf16w-4bit-lean-offload", {"release_gradients": True, "max_grad_norm": 1.0, "release_bucket_bytes": 1}),
    ("bf16w-4bit-lean-hostcorr", {}),
], ids=["offload", "bf16w-offload+release-per-param", "hostcorr"])
def test_shared_slabs_save_load_and_resume_bit_for_bit(preset, options):
    """Through torch.save/torch.load into an optimizer that trained other steps: the resumed run
    equals the uninterrupted one, and both equal a run whose states have allocations of their own."""
    runs = {}
    for slab in (0, 1 << 20):
        model, opt = _build(preset, slab, options)
        train_steps(model, opt, 2, seed=1)
        saved_model = torch.load(io.BytesIO(_saved(model.state_dict())), weights_only=True)
        saved_opt = torch.load(io.BytesIO(_saved(opt.state_dict())), weights_only=True)
        expected = train_steps(model, opt, 2, seed=4)
        if slab:
            assert opt._engine.pinned.slabs_allocated > 0
        model2, opt2 = _build(preset, slab, options)
        train_steps(model2, opt2, 1, seed=100)
        model2.load_state_dict(saved_model)
        opt2.load_state_dict(saved_opt)
        assert train_steps(model2, opt2, 2, seed=4) == expected
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), model2.parameters()))
        runs[slab] = [p.detach().clone() for p in model.parameters()]
    assert all(torch.equal(p, q) for p, q in zip(runs[0], runs[1 << 20]))
