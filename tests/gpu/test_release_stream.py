"""Gradient release on a side stream (CUDA): updates run beside backward, ordered by events only.

Bit for bit the same as the updates on the backward stream, and as no release (one batch holds
the step: the exact global clip), for resident, host-correction, fully offloaded and budgeted
state, with several batches per backward (a small ``release_bucket_bytes``: the lead bound) and
without; the side stream is joined before the weights are read."""
import pytest
import torch

import optstate_core as oc
from optstate_core.schedule import release as release_mod

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

CASES = [("8bit", {}), ("bf16w-4bit-lean", {}), ("bf16w-4bit-lean-hostcorr", {}),
         ("bf16w-4bit-lean-offload", {}), ("bf16w-4bit-lean", {"gpu_budget": 2 * 2**20})]


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(256, 2048), torch.nn.GELU(), torch.nn.LayerNorm(2048),
                               torch.nn.Linear(2048, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 256)).cuda()


def _train(preset, options, release, side=True, bucket=None, steps=4, monkeypatch=None):
    monkeypatch.setattr(release_mod, "SIDE_STREAM", side)
    model = _model()
    if oc.presets.has_master_weights(preset):
        oc.cast_model(model)
    extra = {} if bucket is None or not release else {"release_bucket_bytes": bucket}
    opt = oc.wrap(torch.optim.AdamW(model.parameters(), lr=1e-3), preset, release_gradients=release,
                  max_grad_norm=1.0, staging_bytes="4MB", **options, **extra)
    dtype = next(model.parameters()).dtype
    g = torch.Generator("cuda").manual_seed(1)
    for _ in range(steps):
        x = torch.randn(64, 256, device="cuda", dtype=dtype, generator=g)
        model(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    weights = [p.detach().clone() for p in model.parameters()]  # read on the compute stream, no sync
    return weights, opt


@pytest.mark.parametrize("preset,options", CASES, ids=[p + ("+budget" if o else "") for p, o in CASES])
def test_side_stream_release_is_bit_identical(preset, options, monkeypatch):
    ref, _ = _train(preset, options, release=False, monkeypatch=monkeypatch)
    whole, opt = _train(preset, options, release=True, monkeypatch=monkeypatch)
    assert opt._engine.gradient_release._side is not None  # the updates ran on the side stream
    assert all(torch.equal(a, b) for a, b in zip(ref, whole))  # one batch: the exact global clip
    batches, _ = _train(preset, options, release=True, bucket=256 * 1024, monkeypatch=monkeypatch)
    inline, _ = _train(preset, options, release=True, bucket=256 * 1024, side=False, monkeypatch=monkeypatch)
    assert all(torch.equal(a, b) for a, b in zip(inline, batches))  # several batches, the lead bound


def test_side_stream_released_backward_never_syncs(monkeypatch):
    monkeypatch.setattr(release_mod, "SIDE_STREAM", True)
    model = _model()
    oc.cast_model(model)
    opt = oc.wrap(torch.optim.AdamW(model.parameters(), lr=1e-3), "bf16w-4bit-lean-offload", release_gradients=True,
                  max_grad_norm=1.0, release_bucket_bytes=256 * 1024, staging_bytes="4MB")
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)

    def step():
        model(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(2):
            step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert opt.last_step_timings["fused_params"] == 0 and all(p.grad is None for p in model.parameters())
