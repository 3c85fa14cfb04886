"""The phase switch (docs/rl.md): park (``offload()``), wake (``reload()``), ``with opt.parked():``.

Every preset, with and without gradient release, on a model with biases and a LayerNorm (so each
run holds compressed state, uncompressed tiny tensors, and with ``bf16w-*`` master corrections):
training 2 steps, parking, waking and training 2 more gives the parameters of a run without the
switch bit for bit, and the stored state comes back byte for byte. On the CPU the host tier is
ordinary memory, but every state changes form (an encoded host-tier value while parked, a raw
tensor again when woken for uncompressed state) exactly as on a GPU.
"""
import functools
import io
import logging

import pytest
import torch

import optstate_core as oc
from helpers import flat_params, train_steps
from optstate_core.presets import has_master_weights
from optstate_core.state.store import is_scalar_state

PRESETS = sorted(oc.PRESETS)
CHECKPOINTED = ["fp32", "8bit", "4bit", "bf16w-8bit", "bf16w-4bit-lean-hostcorr", "bf16w-4bit-lean-offload"]


def build(preset, release=False, model_seed=0, fused=None):
    torch.manual_seed(model_seed)
    # Linear(32, 128).weight (4096 elements) is compressed; Linear(128, 8).weight, the biases and the
    # LayerNorm (below 4096 elements) stay uncompressed in the presets that keep small tensors fp32
    model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.LayerNorm(128), torch.nn.GELU(),
                                torch.nn.Linear(128, 8))
    if has_master_weights(preset):
        oc.cast_model(model)
    opt = oc.wrap(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1), preset,
                  release_gradients=release, fused=fused)
    return model, opt


@functools.lru_cache(maxsize=None)
def reference(preset, release, fused=None):
    """The parameters after 4 steps without a phase switch (batches 1-4)."""
    model, opt = build(preset, release, fused=fused)
    train_steps(model, opt, 4, seed=1)
    return flat_params(model)


def stored(opt):
    """Every stored state value by (parameter index, key): its payload tensors, cloned."""
    out = {}
    for i, p in enumerate(q for g in opt.param_groups for q in g["params"]):
        for key, value in opt.state[p].items():
            if isinstance(value, oc.EncodedTensor):
                out[i, key] = (value.codec.name, {k: t.clone() for k, t in value.payload.items()})
            elif isinstance(value, torch.Tensor):
                out[i, key] = ("raw", {"": value.clone()})
            else:
                out[i, key] = ("scalar", value)
    return out


def same_stored(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k][0] == b[k][0], k
        if a[k][0] == "scalar":
            assert a[k][1] == b[k][1], k
        else:
            assert a[k][1].keys() == b[k][1].keys() and all(torch.equal(a[k][1][n], b[k][1][n]) for n in a[k][1]), k


def parked_everywhere(opt):
    report = opt.memory_report()
    return opt.is_parked and report["device_bytes"] == 0 and report["host_bytes"] == report["state_bytes"] > 0


@pytest.mark.parametrize("release", [False, True], ids=["step", "release"])
@pytest.mark.parametrize("preset", PRESETS)
def test_park_wake_continues_bit_for_bit(preset, release):
    model, opt = build(preset, release)
    train_steps(model, opt, 2, seed=1)
    kinds = {v.codec.name if isinstance(v, oc.EncodedTensor) else "raw" for st in opt.state.values()
             for v in st.values() if not is_scalar_state(v)}
    if preset != "4bit-all" and "offload" not in preset:
        assert "raw" in kinds, kinds  # uncompressed state on the device: the form that failed to wake
    before, state_bytes = stored(opt), opt.memory_report()["state_bytes"]
    opt.offload()
    assert parked_everywhere(opt) and opt.memory_report()["state_bytes"] == state_bytes
    held = {id(v) for st in opt.state.values() for v in st.values()}
    opt.offload()  # idempotent: nothing moves again
    assert held == {id(v) for st in opt.state.values() for v in st.values()}
    opt.reload()
    opt.reload()
    assert not opt.is_parked
    same_stored(before, stored(opt))  # the same bytes in the same forms
    train_steps(model, opt, 2, seed=3)
    assert torch.equal(flat_params(model), reference(preset, release))


@pytest.mark.parametrize("preset", ["bf16w-8bit-lean-hostcorr"])
def test_park_wake_on_the_fused_path(preset):
    """The Triton kernels (interpreted here: one preset, for time) keep uncompressed state of bf16
    parameters in fp32 (it parks and wakes in that dtype); int8 moments, the correction on the host."""
    model, opt = build(preset, fused=True)
    train_steps(model, opt, 2, seed=1)
    assert opt.last_step_timings["fused_params"] == 6
    before = stored(opt)
    with opt.parked():
        assert parked_everywhere(opt)
    same_stored(before, stored(opt))
    train_steps(model, opt, 2, seed=3)
    assert torch.equal(flat_params(model), reference(preset, False, fused=True))


def roundtrip(sd):
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("saved_parked, loaded_parked", [(True, False), (False, True), (True, True)],
                         ids=["parked-to-woken", "woken-to-parked", "parked-to-parked"])
@pytest.mark.parametrize("preset", CHECKPOINTED)
def test_checkpoints_cross_the_phases(preset, saved_parked, loaded_parked):
    model, opt = build(preset)
    train_steps(model, opt, 2, seed=1)
    if saved_parked:
        opt.offload()
    ckpt = roundtrip({"model": model.state_dict(), "opt": opt.state_dict()})
    assert opt.is_parked == saved_parked  # saving does not change the phase
    model2, opt2 = build(preset, model_seed=7)
    model2.load_state_dict(ckpt["model"])
    if loaded_parked:
        opt2.offload()
    opt2.load_state_dict(ckpt["opt"])
    assert opt2.is_parked == loaded_parked
    if loaded_parked:
        assert parked_everywhere(opt2)  # loaded state lands parked
        opt2.reload()
    if saved_parked:
        opt.reload()
    same_stored(stored(opt), stored(opt2))
    for m, o in ((model, opt), (model2, opt2)):
        train_steps(m, o, 2, seed=3)
    assert torch.equal(flat_params(model2), reference(preset, False))
    assert torch.equal(flat_params(model), reference(preset, False))


@pytest.mark.parametrize("release", [False, True], ids=["step", "release"])
@pytest.mark.parametrize("preset", ["8bit", "bf16w-4bit-lean"])
def test_an_update_while_parked_wakes_the_state(preset, release, caplog):
    """Chosen rule: the first update after a park (step(), or with release the first gradient
    released in backward) wakes the state first, exactly as reload() would; said once in the log."""
    model, opt = build(preset, release)
    train_steps(model, opt, 2, seed=1)
    opt.offload()
    with caplog.at_level(logging.INFO, logger="optstate"):
        train_steps(model, opt, 1, seed=3)
        assert not opt.is_parked
        opt.offload()
        train_steps(model, opt, 1, seed=4)
    woke = [r.getMessage() for r in caplog.records if "woke the parked optimizer state" in r.getMessage()]
    assert len(woke) == 1 and "reload()" in woke[0]
    assert woke[0].startswith("optstate: a gradient released in backward" if release else "optstate: step()")
    assert not opt.is_parked and opt.memory_report()["host_bytes"] == 0
    assert torch.equal(flat_params(model), reference(preset, release))


@pytest.mark.parametrize("preset", ["fp32", "4bit", "bf16w-8bit-lean-hostcorr"])
def test_parked_context_manager(preset):
    model, opt = build(preset)
    train_steps(model, opt, 2, seed=1)
    before = stored(opt)
    with opt.parked() as phase:
        assert parked_everywhere(opt) and phase is not None
    assert not opt.is_parked
    with pytest.raises(RuntimeError, match="rollout failed"):
        with opt.parked(empty_cache=False):
            assert opt.is_parked
            raise RuntimeError("rollout failed")
    assert not opt.is_parked  # woken although the block raised
    opt.offload()
    with opt.parked():  # already parked when the block began: left parked
        pass
    assert opt.is_parked
    opt.reload()
    same_stored(before, stored(opt))
    train_steps(model, opt, 2, seed=3)
    assert torch.equal(flat_params(model), reference(preset, False))


def test_bad_arguments_are_named_and_change_nothing():
    model, opt = build("8bit")
    train_steps(model, opt, 2, seed=1)
    before = stored(opt)
    held = {id(v) for st in opt.state.values() for v in st.values()}
    for bad in ("yes", 1, None):
        with pytest.raises(ValueError, match="empty_cache must be True or False"):
            opt.offload(empty_cache=bad)
        with pytest.raises(ValueError, match="empty_cache must be True or False"):
            opt.parked(empty_cache=bad)
        assert not opt.is_parked and held == {id(v) for st in opt.state.values() for v in st.values()}
    opt.offload()
    parked = {id(v) for st in opt.state.values() for v in st.values()}
    with pytest.raises(ValueError, match="empty_cache"):
        opt.offload(empty_cache="no")
    assert opt.is_parked and parked == {id(v) for st in opt.state.values() for v in st.values()}
    with pytest.raises(TypeError):
        opt.reload(True)
    assert opt.is_parked
    opt.reload()
    same_stored(before, stored(opt))


def test_state_of_its_own_shape_parks_and_wakes():
    """Adafactor's factored statistics (shapes [rows] and [cols], not the parameter's) are kept
    as the optimizer made them; a park and wake leaves them, and the continuation, unchanged."""
    def run(switch):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.LayerNorm(128), torch.nn.Linear(128, 8))
        opt = oc.wrap(torch.optim.Adafactor(model.parameters(), lr=1e-2), "8bit")
        train_steps(model, opt, 2, seed=1)
        if switch:
            w = model[0].weight
            assert any(v.dim() and tuple(v.shape) != tuple(w.shape) for v in opt.state[w].values()
                       if isinstance(v, torch.Tensor))
            before = stored(opt)
            with opt.parked():
                assert opt.is_parked
            same_stored(before, stored(opt))
        train_steps(model, opt, 2, seed=3)
        return flat_params(model)
    assert torch.equal(run(True), run(False))
