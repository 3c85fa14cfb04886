"""Shared pinned slabs (``OPTSTATE_PINNED_SLAB_BYTES``): states carved from shared host buffers save,
load and resume as states with allocations of their own. The suite has no CUDA: the arena hands
out ordinary host memory (``pin=False``) through the same code."""
import io

import pytest
import torch

import optstate_core as oc
from optstate_core.state.pinned import PinnedArena

from helpers import mlp, train_steps

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
    opt._engine.pinned.end_ahead()
    opt._engine.pinned = PinnedArena(slab_bytes=slab, pin=False)
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
        train_steps(model, opt, 3, seed=1)
        saved_model = torch.load(io.BytesIO(_saved(model.state_dict())), weights_only=True)
        saved_opt = torch.load(io.BytesIO(_saved(opt.state_dict())), weights_only=True)
        expected = train_steps(model, opt, 3, seed=4)
        if slab:
            assert opt._engine.pinned.slabs_allocated > 0
        model2, opt2 = _build(preset, slab, options)
        train_steps(model2, opt2, 2, seed=100)
        model2.load_state_dict(saved_model)
        opt2.load_state_dict(saved_opt)
        assert train_steps(model2, opt2, 3, seed=4) == expected
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), model2.parameters()))
        runs[slab] = [p.detach().clone() for p in model.parameters()]
    assert all(torch.equal(p, q) for p, q in zip(runs[0], runs[1 << 20]))
