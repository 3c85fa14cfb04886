"""optstate_core/apps/warm_start.py: the thread that starts cuBLAS and attention while a model is
built runs its kernels without touching a random number generator, reports a failure instead of
raising it, and refuses bad shapes by name."""
import pytest
import torch

from optstate_core.apps import warm_start


@pytest.mark.parametrize("kwargs, name", [
    (dict(heads=0), "heads"), (dict(heads=32, kv_heads=-1), "kv_heads"), (dict(heads=32, head_dim=2.5), "head_dim"),
    (dict(heads=True), "heads"), (dict(heads=32, kv_heads=5), "multiple of kv_heads")])
def test_bad_shapes_are_refused_by_name(kwargs, name):
    with pytest.raises(ValueError, match=name):
        warm_start.start("cpu", **kwargs)


def test_nothing_to_warm_off_cuda():
    assert warm_start.start("cpu", heads=4, kv_heads=2, head_dim=16) is None


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 2)])
def test_kernels_touch_no_random_number_generator(heads, kv_heads):
    state = torch.random.get_rng_state()
    warm_start.run_kernels(torch.device("cpu"), heads, kv_heads, 16, torch.float32, seq=32)
    assert torch.equal(torch.random.get_rng_state(), state)


def test_a_failure_is_reported_not_raised(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no cuDNN here")
    monkeypatch.setattr(warm_start, "run_kernels", broken)
    warm = warm_start.WarmStart(torch.device("cpu"), 4, 2, 16, torch.float32).join(timeout=60)
    summary = warm.summary()
    assert summary["error"] == "RuntimeError: no cuDNN here"
    assert summary["seconds"] is not None and summary["seconds"] >= 0


def test_a_cpu_thread_runs_to_the_end():
    warm = warm_start.WarmStart(torch.device("cpu"), 4, 2, 16, torch.float32).join(timeout=120)
    summary = warm.summary()
    assert summary["error"] is None and summary["seconds"] > 0
