"""The phase switch on a GPU (docs/rl.md): a park hands the state's device memory back
(``memory_allocated`` drops by at least the state's device bytes; with ``empty_cache`` the caching
allocator keeps under 0.5 GiB unused), a wake restores it, and training continues bit for bit as
without the switch, for compressed, uncompressed and master-weight state, with and without
gradient release (an update while parked wakes the state first), and for state of its own shape;
later parks reuse the first one's pinned buffers, and ``prepare_park()`` pins them ahead."""
import pytest
import torch

import optstate_core as oc

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

CASES = [("8bit", False), ("fp32", False), ("4bit", False), ("bf16w-4bit-lean", False),
         ("bf16w-8bit-lean-hostcorr", False), ("bf16w-4bit-lean", True), ("8bit", True)]


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(256, 2048), torch.nn.GELU(), torch.nn.LayerNorm(2048),
                               torch.nn.Linear(2048, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 256)).cuda()


def _build(preset, release, make_inner=None):
    model = _model()
    if oc.presets.has_master_weights(preset):
        oc.cast_model(model)
    inner = (make_inner or (lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1)))(model.parameters())
    return model, oc.wrap(inner, preset, release_gradients=release)


def _train(model, opt, steps, seed):
    dtype = next(model.parameters()).dtype
    g = torch.Generator("cuda").manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(64, 256, device="cuda", dtype=dtype, generator=g)
        model(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def _params(model):
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("preset,release", CASES, ids=[p + ("+release" if r else "") for p, r in CASES])
def test_park_frees_the_state_and_wake_restores_exactness(preset, release):
    ref_model, ref = _build(preset, release)
    _train(ref_model, ref, 2, seed=1)
    _train(ref_model, ref, 2, seed=2)
    expected = _params(ref_model)
    del ref_model, ref

    model, opt = _build(preset, release)
    _train(model, opt, 2, seed=1)
    torch.cuda.synchronize()
    state_bytes = opt.memory_report()["device_bytes"]
    assert state_bytes > 0
    allocated = torch.cuda.memory_allocated()
    with opt.parked(empty_cache=True):
        torch.cuda.synchronize()
        assert opt.memory_report()["device_bytes"] == 0
        assert allocated - torch.cuda.memory_allocated() >= state_bytes
        assert torch.cuda.memory_reserved() - torch.cuda.memory_allocated() < 2**29
        opt.offload(empty_cache=True)  # idempotent
        assert opt.memory_report()["device_bytes"] == 0
    assert opt.memory_report()["device_bytes"] == state_bytes
    _train(model, opt, 2, seed=2)
    assert all(torch.equal(a, b) for a, b in zip(_params(model), expected))


@pytest.mark.parametrize("preset,release", [("8bit", False), ("bf16w-4bit-lean", True)])
def test_an_update_while_parked_wakes_on_the_gpu(preset, release):
    ref_model, ref = _build(preset, release)
    _train(ref_model, ref, 3, seed=1)
    model, opt = _build(preset, release)
    dtype = next(model.parameters()).dtype
    g = torch.Generator("cuda").manual_seed(1)
    for step in range(3):
        x = torch.randn(64, 256, device="cuda", dtype=dtype, generator=g)
        if step:
            opt.offload()  # parked through forward and backward: the update wakes it first
        model(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        assert not opt.is_parked
    assert all(torch.equal(a, b) for a, b in zip(_params(model), _params(ref_model)))


def test_state_of_its_own_shape_leaves_the_gpu_and_comes_back():
    def make(ps):
        return torch.optim.Adafactor(ps, lr=1e-2)
    ref_model, ref = _build("8bit", False, make)
    _train(ref_model, ref, 4, seed=1)
    model, opt = _build("8bit", False, make)
    g = torch.Generator("cuda").manual_seed(1)
    for step in range(4):
        x = torch.randn(64, 256, device="cuda", generator=g)
        model(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step == 1:
            weight = model[3].weight
            own = [k for k, v in opt.state[weight].items() if isinstance(v, torch.Tensor) and v.dim()
                   and tuple(v.shape) != tuple(weight.shape)]
            assert own
            with opt.parked():
                assert all(opt.state[weight][k].device.type == "cpu" for k in own)
            assert all(opt.state[weight][k].device == weight.device for k in own)
    assert all(torch.equal(a, b) for a, b in zip(_params(model), _params(ref_model)))


def test_parks_reuse_their_pinned_buffers_and_a_prepared_first_park_pins_nothing():
    """prepare_park() pins the host buffers on a thread after the first step; no park then makes a
    pinned block (torch's host allocator counts them), the buffers are page-locked, the pinned bytes
    held stay those of the first park, and training continues bit for bit."""
    ref_model, ref = _build("bf16w-4bit-lean", False)
    _train(ref_model, ref, 2, seed=1)
    _train(ref_model, ref, 2, seed=2)
    model, opt = _build("bf16w-4bit-lean", False)
    opt.prepare_park()
    _train(model, opt, 2, seed=1)
    opt.prepare_park(wait=True)
    torch.cuda.synchronize()
    held = opt.memory_report()["park_buffers"]
    assert held["bytes"] == opt.memory_report()["device_bytes"] > 0 and held["pinned_bytes"] >= held["bytes"]
    blocks = torch.cuda.host_memory_stats().get("num_host_alloc")
    for _ in range(4):
        with opt.parked(empty_cache=True):
            values = [v for st in opt.state.values() for v in st.values() if isinstance(v, oc.EncodedTensor)]
            assert values and all(t.is_pinned() for v in values for t in v.payload.values())
    if blocks is not None:
        assert torch.cuda.host_memory_stats()["num_host_alloc"] == blocks
    assert opt.memory_report()["park_buffers"] == held
    _train(model, opt, 2, seed=2)
    assert all(torch.equal(a, b) for a, b in zip(_params(model), _params(ref_model)))


def test_a_park_frees_the_staging_ring_of_streamed_state():
    """``offload`` keeps its state in host memory and streams it through a device ring every step:
    a park hands the ring back (memory_allocated drops by its size), the next step makes it again,
    and training continues bit for bit."""
    ref_model, ref = _build("offload", False)
    _train(ref_model, ref, 2, seed=1)
    _train(ref_model, ref, 2, seed=2)
    model, opt = _build("offload", False)
    _train(model, opt, 2, seed=1)
    torch.cuda.synchronize()
    assert opt.memory_report()["device_bytes"] == 0
    allocated = torch.cuda.memory_allocated()
    with opt.parked(empty_cache=True):
        torch.cuda.synchronize()
        assert allocated - torch.cuda.memory_allocated() >= 2**20  # the ring (staging_bytes: 256 MiB)
        assert torch.cuda.memory_reserved() - torch.cuda.memory_allocated() < 2**29
    _train(model, opt, 2, seed=2)
    assert all(torch.equal(a, b) for a, b in zip(_params(model), _params(ref_model)))
