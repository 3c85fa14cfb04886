"""Real-GPU checks (skipped without CUDA): the fused step never syncs with the host, is captured
in a CUDA graph, and is picked automatically. (tests/kernels also run on the GPU when present.)"""
import copy

import pytest
import torch

import optstate_core as oc
from helpers import capture_step, steps_without_host_sync

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SHAPES = [(512, 1024), (4096,), (300, 700), (7,)]


def step_without_sync(opt, steps: int = 1):
    """``opt.step()`` with CUDA's sync debug mode raising on any host synchronisation."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(steps):
            opt.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def setup(preset, lr=1e-3, **kw):
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(s, device="cuda") * 0.1) for s in SHAPES]
    for p in ps:
        p.grad = torch.randn_like(p) * 1e-2
    opt = oc.wrap(torch.optim.AdamW(ps, lr=lr), oc.make_policy(preset, min_int8_elements=0,
                                                               whole_blocks_1d=False), **kw)
    return ps, opt


@pytest.mark.parametrize("preset", ["8bit", "4bit", "bf16"])
def test_fused_step_is_automatic_and_never_syncs(preset):
    ps, opt = setup(preset)
    opt.step()  # first step allocates state
    assert opt.last_step_timings["fused_params"] == len(SHAPES)
    step_without_sync(opt, 3)
    assert opt.last_step_timings["fused_params"] == len(SHAPES)


@pytest.mark.parametrize("preset", ["4bit", "8bit"])
def test_fused_step_in_a_cuda_graph(preset):
    """Replays equal eager steps bit for bit, stochastic rounding included: the kernels read the
    step count (hence the rounding stream) from the device, and the replay advances it."""
    ps, opt = setup(preset, lr=torch.tensor(1e-3, device="cuda"))
    twin_ps, twin = setup(preset, lr=torch.tensor(1e-3, device="cuda"))
    for o in (opt, twin):
        for _ in range(2):
            o.step()
    torch.cuda.synchronize()
    graph = capture_step(opt.step, warm=lambda: (opt.step(), twin.step()))  # warms the pointer tables
    for _ in range(3):
        graph.replay()
        twin.step()
    torch.cuda.synchronize()
    for p, q in zip(ps, twin_ps):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    assert float(opt.state[ps[0]]["step"]) == float(twin.state[twin_ps[0]]["step"])


def test_nonfinite_skip_on_gpu():
    """Per 256-element block: the block holding the NaN keeps its values, the rest steps."""
    ps, opt = setup("8bit")
    opt.step()
    ps[1].grad[5] = float("nan")
    before = ps[1].detach().clone()
    opt.step()
    assert torch.equal(ps[1][:256], before[:256])
    assert (ps[1][256:] != before[256:]).float().mean() > 0.9 and torch.isfinite(ps[1]).all()
    assert opt.memory_report()["nonfinite_skipped"] == 1


def test_fp32_passthrough_checks_gradients_in_backward():
    """With check_in_backward, from the second step on, the passthrough step (torch's fused AdamW on
    raw state: bf16 parameters here; fp32 ones go to our kernel, test_torch_fused_exact.py) uses the
    NaN/inf maxima that backward hooks took on a side stream (backward_check.py), still
    bit-identical to torch's fused AdamW and sync-free; a NaN from backward skips the step, and a
    gradient changed after backward (in place, or replaced) is checked again in the step, so its
    NaN skips the step too."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10)).cuda().bfloat16()
    ref_model = copy.deepcopy(model)
    opt = oc.wrap(torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True), "fp32", check_in_backward=True)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-3, fused=True)
    params = list(model.parameters())
    check = opt._engine.backward_check
    skips = 0
    for step in range(7):
        x = torch.randn(32, 64, device="cuda", dtype=torch.bfloat16)
        if step == 5:
            x[0, 0] = float("nan")  # the NaN comes out of backward itself
        for m in (model, ref_model):
            m.zero_grad(set_to_none=True)
            m(x).square().mean().backward()
        if step == 3:
            params[0].grad[0, 0] = float("inf")  # in place, after the hook saw the gradient
        if step == 4:
            params[2].grad = params[2].grad.clone()
            params[2].grad[1] = float("nan")  # a new tensor, after the hook
        before = [p.detach().clone() for p in params]
        step_without_sync(opt)
        if step == 0:
            assert check.used == 0  # the hooks are registered by the first step's plan
        elif step in (3, 4):
            assert check.used == len(params) - 1  # the changed gradient was checked in the step
        else:
            assert check.used == len(params)
        if step in (3, 4, 5):
            skips += len(params)
            assert all(torch.equal(p, b) for p, b in zip(params, before)), step
            continue
        ref.step()
        assert all(torch.equal(p, q) for p, q in zip(params, ref_model.parameters())), step
    assert opt.memory_report()["nonfinite_skipped"] == skips
    copied = copy.deepcopy(opt)  # streams and weak references are not copied
    assert not copied._engine.backward_check.active
    off = oc.wrap(torch.optim.AdamW(ref_model.parameters(), lr=1e-3, fused=True), "fp32")  # the default
    for _ in range(2):
        ref_model.zero_grad(set_to_none=True)
        ref_model(torch.randn(32, 64, device="cuda", dtype=torch.bfloat16)).square().mean().backward()
        off.step()
    assert off._engine.backward_check.used == 0 and not off._engine.backward_check.active


def test_backward_checks_without_steps_hold_no_old_gradients():
    """Backwards without a step (gradients dropped each time) must not pile up gradients that the
    side stream has finished reading: only reads still in flight keep theirs."""
    model = torch.nn.Linear(256, 256).cuda().bfloat16()  # bf16: the passthrough (fp32 goes to our kernel)
    opt = oc.wrap(torch.optim.AdamW(model.parameters(), fused=True), "fp32", check_in_backward=True)
    x = torch.randn(8, 256, device="cuda", dtype=torch.bfloat16)
    for _ in range(2):
        model(x).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    for _ in range(20):
        model(x).sum().backward()
        torch.cuda.synchronize()
        opt.zero_grad(set_to_none=True)
    check = opt._engine.backward_check
    assert len(check._reading) == 1 and len(check._seen) == 2


def test_a_captured_fp32_step_checks_the_gradients_of_each_replay():
    """A passthrough step captured in a CUDA graph checks its gradients inside the graph: maxima
    that a backward took before the capture would be stale at every replay."""
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 32).cuda().bfloat16()  # bf16: the passthrough (fp32 goes to our kernel)
    inner = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-3, device="cuda"), fused=True, capturable=True)
    opt = oc.wrap(inner, "fp32", check_in_backward=True)
    x = torch.randn(16, 64, device="cuda", dtype=torch.bfloat16)

    def backward():  # into the same gradient tensors every time (zero_grad keeps them)
        opt.zero_grad(set_to_none=False)
        model(x).square().mean().backward()

    for _ in range(2):
        backward()
        opt.step()
    assert opt._engine.backward_check.used == 2  # eager steps use the backward's maxima
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        backward()
        opt.step()
    torch.cuda.current_stream().wait_stream(stream)
    backward()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt.step()
    assert opt._engine.backward_check.used == 0
    for nan in (False, True, False):
        backward()
        if nan:
            model.weight.grad[0, 0] = float("nan")
        before = [p.detach().clone() for p in model.parameters()]
        graph.replay()
        torch.cuda.synchronize()
        moved = [not torch.equal(p, b) for p, b in zip(model.parameters(), before)]
        assert moved == [not nan] * 2, nan
        assert all(torch.isfinite(p).all() for p in model.parameters())


def _flat(ps):
    return torch.cat([p.detach().reshape(-1) for p in ps])


@pytest.mark.parametrize("options", [dict(offload=True, staging_bytes="4MB"),
                                     dict(gpu_budget="3MB", staging_bytes="2MB")], ids=["offloaded", "budgeted"])
def test_streamed_state_matches_resident_and_never_syncs(options):
    ps, opt = setup("8bit", **options)
    ref_ps, ref = setup("8bit")
    for _ in range(2):
        opt.step()
        ref.step()
    assert opt.memory_report()["host_bytes"] > 0
    step_without_sync(opt, 3)
    for _ in range(3):
        ref.step()
    assert opt.last_step_timings["h2d_bytes"] > 0
    torch.testing.assert_close(_flat(ps), _flat(ref_ps), rtol=0, atol=0)


def test_close_releases_device_and_pinned_memory():
    """10 create/use/close cycles: no growth of device or pinned host memory after the first."""
    import gc

    def host_allocated():
        torch.empty(1, pin_memory=True)  # lets the host allocator reclaim blocks whose copies finished
        stats = getattr(torch.cuda, "host_memory_stats", lambda: {})()
        keys = [k for k in stats if "allocated" in k and k.endswith("current")]
        return stats[keys[0]] if keys else None

    def cycle():
        ps, opt = setup("8bit", offload=True, staging_bytes="4MB")
        for _ in range(2):
            opt.step()
        opt.close()
        del ps, opt
        gc.collect()
        torch.cuda.synchronize()

    cycle()
    base_dev, base_host = torch.cuda.memory_allocated(), host_allocated()
    for _ in range(9):
        cycle()
    # one optimizer holds ~1 MiB of pinned state here: 9 leaked cycles would add >= 9 MiB
    assert torch.cuda.memory_allocated() <= base_dev
    if base_host is not None:
        assert host_allocated() <= base_host + 64 * 1024


def test_prefetch_during_backward_on_gpu():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 1024)).cuda()
    twin = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 1024)).cuda()
    twin.load_state_dict(model.state_dict())
    opt = oc.wrap(torch.optim.AdamW(model.parameters()), "8bit", offload=True, prefetch_budget="auto")
    ref = oc.wrap(torch.optim.AdamW(twin.parameters()), "8bit", offload=True, prefetch_budget=0)
    for step in range(5):
        x = torch.randn(64, 1024, device="cuda", generator=torch.Generator("cuda").manual_seed(step))
        for m, o in ((model, opt), (twin, ref)):
            o.zero_grad()
            m(x).square().mean().backward()
            o.step()
    torch.testing.assert_close(_flat(model.parameters()), _flat(twin.parameters()), rtol=0, atol=0)


@pytest.mark.parametrize("preset", ["8bit", "4bit", "bf16w-4bit-lean", "bf16w-4bit-lean-hostcorr"])
def test_released_backward_never_syncs(preset):
    """Gradient release with clipping: a whole training step (forward, the released backward whose
    hooks clip and update every tensor, biases and norms included, then step()) runs with CUDA's
    sync debug mode raising on any host synchronisation, once the first steps built the plans."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.LayerNorm(1024),
                                torch.nn.Linear(1024, 256)).cuda()
    if oc.presets.has_master_weights(preset):
        oc.cast_model(model)
    opt = oc.wrap(torch.optim.AdamW(model.parameters(), lr=1e-3), preset, release_gradients=True, max_grad_norm=1.0)
    dtype = next(model.parameters()).dtype
    steps_without_host_sync(model, opt, torch.randn(64, 256, device="cuda", dtype=dtype))
    assert opt.step_count == 5 and opt.last_step_timings["fused_params"] == 0  # every tensor updated in its hook
    assert all(p.grad is None for p in model.parameters())
