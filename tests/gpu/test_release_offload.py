"""Gradient release over streamed state on a GPU: resident, host correction, fully offloaded
(``bf16w-4bit-lean-offload``) and budgeted state (``gpu_budget``) train bit for bit as without
release (one batch holds the step: the exact global clip) and as one update per batch when a small
``release_bucket_bytes`` splits backward into several; a released backward over offloaded state
never synchronises the host."""
import pytest
import torch

import optstate_core as oc
from helpers import steps_without_host_sync

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

CASES = [("8bit", {}), ("bf16w-4bit-lean", {}), ("bf16w-4bit-lean-hostcorr", {}),
         ("bf16w-4bit-lean-offload", {}), ("bf16w-4bit-lean", {"gpu_budget": 2 * 2**20})]


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(256, 2048), torch.nn.GELU(), torch.nn.LayerNorm(2048),
                               torch.nn.Linear(2048, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 256)).cuda()


def _train(preset, options, release, bucket=None, clip=1.0, steps=4):
    model = _model()
    if oc.presets.has_master_weights(preset):
        oc.cast_model(model)
    extra = {} if bucket is None or not release else {"release_bucket_bytes": bucket}
    opt = oc.wrap(torch.optim.AdamW(model.parameters(), lr=1e-3), preset, release_gradients=release,
                  max_grad_norm=clip, staging_bytes="4MB", **options, **extra)
    dtype = next(model.parameters()).dtype
    g = torch.Generator("cuda").manual_seed(1)
    for _ in range(steps):
        x = torch.randn(64, 256, device="cuda", dtype=dtype, generator=g)
        model(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()], opt


@pytest.mark.parametrize("preset,options", CASES, ids=[p + ("+budget" if o else "") for p, o in CASES])
def test_release_over_streamed_state_is_bit_identical(preset, options):
    ref, _ = _train(preset, options, release=False)
    whole, opt = _train(preset, options, release=True)
    assert opt.last_step_timings["fused_params"] == 0  # every tensor was updated in backward
    assert all(torch.equal(a, b) for a, b in zip(ref, whole))  # one batch: the exact global clip
    if options or preset.endswith("offload"):
        assert opt.memory_report()["host_bytes"] > 0
    unclipped, _ = _train(preset, options, release=False, clip=None)
    batches, _ = _train(preset, options, release=True, bucket=256 * 1024, clip=None)
    assert all(torch.equal(a, b) for a, b in zip(unclipped, batches))  # several batches per backward


def test_released_backward_over_offloaded_state_never_syncs():
    model = _model()
    oc.cast_model(model)
    opt = oc.wrap(torch.optim.AdamW(model.parameters(), lr=1e-3), "bf16w-4bit-lean-offload", release_gradients=True,
                  max_grad_norm=1.0, release_bucket_bytes=256 * 1024, staging_bytes="4MB")
    steps_without_host_sync(model, opt, torch.randn(64, 256, device="cuda", dtype=torch.bfloat16))
    assert opt.last_step_timings["fused_params"] == 0 and all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("preset,options", CASES[3:], ids=["offload", "budget"])
def test_nan_gradient_over_staged_state_skips_and_counts_its_parameter(preset, options):
    """A NaN gradient in one step of a released backward over streamed (staged) state: its
    parameter is counted once and skipped as without release, bit for bit (the staged launches
    raise the batch's own flags)."""
    runs = []
    for release in (False, True):
        model = _model()
        oc.cast_model(model)
        calls = []
        model[3].weight.register_hook(lambda g: g.fill_(float("nan")) if calls.append(1) or len(calls) == 2 else g)
        opt = oc.wrap(torch.optim.AdamW(model.parameters(), lr=1e-3), preset, release_gradients=release,
                      max_grad_norm=None, staging_bytes="4MB", **options,
                      **({"release_bucket_bytes": 256 * 1024} if release else {}))
        g = torch.Generator("cuda").manual_seed(1)
        for _ in range(3):
            model(torch.randn(64, 256, device="cuda", dtype=torch.bfloat16, generator=g)).float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        runs.append(([p.detach().clone() for p in model.parameters()], opt.memory_report()["nonfinite_skipped"]))
    assert runs[0][1] == runs[1][1] == 1
    assert all(torch.equal(a, b) for a, b in zip(runs[0][0], runs[1][0]))


@pytest.mark.parametrize("preset,options", CASES[3:], ids=["offload", "budget"])
def test_first_step_takes_its_pinned_state_from_the_thread_that_pinned_it_ahead(preset, options, monkeypatch):
    """wrap() pins the first step's host state on a thread (schedule/pin_ahead.py): the step takes
    every allocation from it, in pinned memory, and trains bit for bit as when it pins for itself."""
    out = []
    for ahead in ("1", "0"):
        monkeypatch.setenv("OPTSTATE_PIN_AHEAD", ahead)
        model = _model()
        oc.cast_model(model)
        opt = oc.wrap(torch.optim.AdamW(model.parameters(), lr=1e-3), preset, release_gradients=True,
                      max_grad_norm=1.0, staging_bytes="4MB", **options)
        pool = opt._engine.pinned.ahead
        assert (pool is not None) == (ahead == "1")
        if pool is not None:  # all pinned before the step asks: every request must match a prediction
            pool.wait()
        g = torch.Generator("cuda").manual_seed(1)
        for _ in range(3):
            model(torch.randn(64, 256, device="cuda", dtype=torch.bfloat16, generator=g)).float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        assert opt._engine.pinned.ahead is None
        if pool is not None:
            assert pool.error is None and pool.planned > 0 and pool.taken == pool.planned
        hosted = [t for st in opt.state.values() for v in st.values() if getattr(v, "host_tier", False)
                  for t in v.payload.values()]
        assert hosted and all(t.is_pinned() for t in hosted)
        out.append([p.detach().clone() for p in model.parameters()])
    for p, q in zip(*out):
        assert torch.equal(p, q)
