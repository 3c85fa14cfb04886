"""Backward-time prefetch on a real GPU (skipped without CUDA): no host synchronisation in the
hooks or in step(), device memory bounded by the prefetch budget plus the staging ring above the
optimizer-free baseline, nothing left behind after close(), results bit-identical to the ring."""
import gc

import pytest
import torch

import optstate_core as oc

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

WIDTH = 1024


def make_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.GELU(), torch.nn.Linear(WIDTH, WIDTH),
                               torch.nn.GELU(), torch.nn.Linear(WIDTH, WIDTH)).cuda()


def make_opt(model, **options):
    return oc.wrap(torch.optim.AdamW(model.parameters(), lr=1e-3), oc.make_policy("8bit", min_int8_elements=0,
                                                                                  whole_blocks_1d=False),
                   offload=True, staging_bytes="8MB", **options)


def batch(step, rows=256):
    return torch.randn(rows, WIDTH, device="cuda", generator=torch.Generator("cuda").manual_seed(step))


def train_step(model, opt, step, rows=256, x=None):
    model(batch(step, rows) if x is None else x).square().mean().backward()
    if opt is not None:
        opt.step()
    model.zero_grad(set_to_none=True)


def _flat(params):
    return torch.cat([p.detach().reshape(-1).float() for p in params])


def test_prefetch_matches_ring_and_never_syncs():
    model, twin = make_model(), make_model()
    opt, ref = make_opt(model, prefetch_budget="64MB"), make_opt(twin, prefetch_budget=0)
    for step in range(3):  # state allocated, plan cached, hooks registered
        train_step(model, opt, step)
        train_step(twin, ref, step)
    xs = [batch(step) for step in range(3, 6)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for x in xs:
            train_step(model, opt, None, x=x)  # hooks stage state in backward; step() consumes it
            train_step(twin, ref, None, x=x)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    report = opt.memory_report()["prefetch"]
    assert report["bytes_by_phase"]["backward"] == opt.memory_report()["host_bytes"]
    assert report["bytes_by_phase"]["step"] == 0
    assert report["backward_upload_ms"] is not None and report["hidden_ms"] >= report["backward_upload_ms"]
    assert torch.equal(_flat(model.parameters()), _flat(twin.parameters()))


@pytest.mark.parametrize("budget", ["4MB", "auto"])
def test_memory_stays_within_budget_and_ring_above_baseline(budget):
    rows = 8192  # activations (~32 MiB each) large enough for the auto budget to take state
    model = make_model()
    for step in range(2):
        train_step(model, None, step, rows)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    train_step(model, None, 2, rows)
    torch.cuda.synchronize()
    baseline_peak = torch.cuda.max_memory_allocated()
    opt = make_opt(model, prefetch_budget=budget)
    for step in range(4):  # allocate, cache the plan, measure the auto budget
        train_step(model, opt, step, rows)
    torch.cuda.synchronize()
    state_on_device = opt.memory_report()["device_bytes"] + 4 * 2**20  # step counters, tables, flags
    ring = opt._engine.schedule._ring.size
    limit = opt._engine.schedule.area.limit(torch.device("cuda"))
    assert limit is not None and limit > 0
    torch.cuda.reset_peak_memory_stats()
    for step in range(4, 8):
        train_step(model, opt, step, rows)
    torch.cuda.synchronize()
    report = opt.memory_report()["prefetch"]
    assert 0 < report["used_bytes_last_step"] <= limit
    assert torch.cuda.max_memory_allocated() <= baseline_peak + limit + ring + state_on_device
    opt.close()


def test_no_growth_over_create_close_cycles():
    model = make_model()
    train_step(model, None, 0)
    torch.cuda.synchronize()
    gc.collect()
    base = torch.cuda.memory_allocated()
    for cycle in range(10):
        opt = make_opt(model, prefetch_budget="16MB")
        for step in range(4):
            train_step(model, opt, 10 * cycle + step)
        assert opt.memory_report()["prefetch"]["bytes_by_phase"]["backward"] > 0
        opt.close()
        del opt
        gc.collect()
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() <= base, cycle
