"""The phase switch's host buffers (optstate_core/schedule/park_buffers.py): kept across park/wake
cycles and reused (no allocation after the first park, the same memory every time), pinned ahead
by ``prepare_park()`` (then the first park allocates nothing), and training still continues bit
for bit. ``pin_memory=True`` with a recording arena over ordinary memory (``helpers.recording_arena``)
takes the pinned path on the CPU and counts its allocations."""
import copy

import pytest
import torch

import optstate_core as oc
from helpers import flat_params, recording_arena, train_steps
from optstate_core.presets import has_master_weights

PRESETS = ["8bit", "fp32", "bf16w-4bit-lean"]


def build(preset, release=False, pinned=True):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.LayerNorm(128), torch.nn.GELU(),
                                torch.nn.Linear(128, 8))
    if has_master_weights(preset):
        oc.cast_model(model)
    opt = oc.wrap(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1), preset,
                  release_gradients=release, pin_memory=pinned or None)
    arena = opt._engine.park_buffers.arena = recording_arena(opt._engine.park_buffers.arena.slab_bytes)
    return model, opt, arena


def reference(preset, release=False):
    model, opt, _ = build(preset, release)
    train_steps(model, opt, 4, seed=1)
    return flat_params(model)


def parked_pointers(opt):
    """(parameter index, key, payload name) -> data pointer of every parked host payload."""
    out = {}
    for i, p in enumerate(q for g in opt.param_groups for q in g["params"]):
        for key, value in opt.state[p].items():
            if isinstance(value, oc.EncodedTensor):
                assert value.host_tier
                out.update({(i, key, name): t.data_ptr() for name, t in value.payload.items()})
    return out


@pytest.mark.parametrize("preset", PRESETS)
def test_later_parks_reuse_the_first_parks_buffers(preset):
    model, opt, arena = build(preset)
    train_steps(model, opt, 2, seed=1)
    state_bytes = opt.memory_report()["device_bytes"]
    assert opt.memory_report()["park_buffers"] == {"bytes": 0, "pinned_bytes": 0, "prepare_seconds": None}
    opt.offload()
    first, asked = parked_pointers(opt), list(arena.asked)
    held = opt.memory_report()["park_buffers"]
    assert first and asked and held["bytes"] == state_bytes and held["pinned_bytes"] == sum(asked)
    opt.reload()
    for _ in range(5):
        opt.offload()
        assert parked_pointers(opt) == first  # the same host memory, nothing new asked for
        opt.reload()
    assert arena.asked == asked and opt.memory_report()["park_buffers"] == held
    train_steps(model, opt, 2, seed=3)
    assert torch.equal(flat_params(model), reference(preset))


@pytest.mark.parametrize("release", [False, True], ids=["step", "release"])
@pytest.mark.parametrize("preset", ["8bit", "bf16w-4bit-lean"])
def test_prepare_park_pins_ahead_so_the_first_park_allocates_nothing(preset, release):
    model, opt, arena = build(preset, release)
    opt.prepare_park()  # no state yet: starts at the end of the first step
    assert arena.asked == []
    train_steps(model, opt, 1, seed=1)
    opt.prepare_park(wait=True)
    asked, report = list(arena.asked), opt.memory_report()
    assert asked and report["park_buffers"]["bytes"] == report["device_bytes"]
    assert report["park_buffers"]["prepare_seconds"] >= 0
    prepared = {k: {n: t.data_ptr() for n, t in v.payload.items()} for k, v in opt._engine.park_buffers.slots.items()}
    train_steps(model, opt, 1, seed=2)
    with opt.parked():
        assert arena.asked == asked  # the park only copied
        assert {(k[0], k[1], n) for k, v in prepared.items() for n in v} == set(parked_pointers(opt))
        assert all(parked_pointers(opt)[(i, key, n)] == ptr for (i, key), v in prepared.items() for n, ptr in v.items())
    opt.prepare_park(wait=True)  # every buffer is there: nothing more
    assert arena.asked == asked
    train_steps(model, opt, 2, seed=3)
    assert torch.equal(flat_params(model), reference(preset, release))


def test_unpinned_parks_reuse_their_buffers_too():
    """Parameters on the CPU (the default there: nothing pinned): the same reuse of host buffers."""
    model, opt, arena = build("8bit", pinned=False)
    train_steps(model, opt, 2, seed=1)
    opt.offload()
    first = parked_pointers(opt)
    opt.reload()
    opt.offload()
    assert parked_pointers(opt) == first and arena.asked == []
    opt.reload()
    train_steps(model, opt, 2, seed=3)
    assert torch.equal(flat_params(model), reference("8bit"))


def test_copies_keep_no_buffers_and_close_drops_them():
    model, opt, _ = build("8bit")
    train_steps(model, opt, 2, seed=1)
    opt.prepare_park(wait=True)
    twin = copy.deepcopy(opt)
    assert twin.memory_report()["park_buffers"]["bytes"] == 0
    assert opt.memory_report()["park_buffers"]["bytes"] > 0
    opt.close()
    assert opt._engine.park_buffers.report()["bytes"] == 0


def test_prepare_park_refuses_a_bad_wait():
    _, opt, arena = build("8bit")
    for bad in ("yes", 1, None):
        with pytest.raises(ValueError, match="wait must be True or False"):
            opt.prepare_park(wait=bad)
    assert arena.asked == [] and not opt._engine.park_buffers.after_first_step
