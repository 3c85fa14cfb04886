"""Launch tables are cached per stream: a launch only reads tables allocated on its own stream.

Under FSDP2 gradient release updates on FSDP's post-reduce stream and ``step()`` on the default
stream. A table allocated on one and read on the other could be freed (a cache clear, a dropped
bucket) while a launch queued on the other still reads it, and the caching allocator would hand
the block to the next allocation of its own stream. Here two fake streams stand for the two (the
stream key is patched), and the caches are made tiny so that they clear within a step.
"""
import contextlib

import pytest
import torch

import optstate_core as oc
from optstate_core.state.master_weights import cast_model

pytest.importorskip("triton")
from optstate_core.step import fused_launch  # noqa: E402
from optstate_core.step.kernels import launch  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = [(16, 256), (300,), (4, 512), (8, 256)]


def model():
    g = torch.Generator().manual_seed(0)
    m = torch.nn.ParameterList([torch.nn.Parameter((torch.randn(s, generator=g) * 0.5).to(DEVICE)) for s in SHAPES])
    cast_model(m)
    return list(m.parameters())


def train(preset, release_stream, steps=4):
    """Gradient release's updates inside ``release_stream()`` (a context), ``step()`` outside."""
    ps = model()
    opt = oc.wrap(torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1), preset, fused=True, release_gradients=True,
                  release_bucket_bytes=0)
    for s in range(steps):
        g = torch.Generator().manual_seed(100 + s)
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g).to(DEVICE, torch.bfloat16)
        with release_stream():
            for p in reversed(ps[1:]):  # the last parameter's gradient is left to step(), as FSDP2's last hook
                opt._engine.schedule.gradient_ready(p)
        opt.step()
    opt.close()
    return ps


@pytest.mark.parametrize("preset", ["bf16w-4bit-lean", "bf16w-4bit-lean-offload"])
def test_launches_read_only_tables_of_their_stream(preset, monkeypatch):
    streams = {"key": 0}

    @contextlib.contextmanager
    def fake_stream(key):
        streams["key"] = key
        try:
            yield
        finally:
            streams["key"] = 0
    made = {}  # storage address -> (stream key it was allocated under, the table: kept, so no address is reused)
    reads = []  # (launch's stream key, keys of the tables it read)
    real_table, real_run = launch.device_table, fused_launch.KernelLauncher._run

    def device_table(values, device, dtype=torch.int64):
        t = real_table(values, device, dtype)
        made[t.untyped_storage().data_ptr()] = (streams["key"], t)
        return t

    def run(self, kernel, n_prog, device, args, kwargs):
        tables = [a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)
                  and a.untyped_storage().data_ptr() in made]
        reads.append((streams["key"], {made[t.untyped_storage().data_ptr()][0] for t in tables}))
        return real_run(self, kernel, n_prog, device, args, kwargs)

    monkeypatch.setattr(launch, "stream_key", lambda device: streams["key"])
    monkeypatch.setattr(launch, "device_table", device_table)
    monkeypatch.setattr(fused_launch.KernelLauncher, "_run", run)
    monkeypatch.setattr(launch, "MAX_CACHED_TABLES", 4)  # clears within every step
    launch.clear_caches()
    on_two = train(preset, lambda: fake_stream(1))
    assert {key for key, _ in reads} == {0, 1}  # both streams launched
    crossed = [(key, seen) for key, seen in reads if seen - {key}]
    assert not crossed, f"launches read tables of another stream: {crossed[:3]}"
    launch.clear_caches()
    on_one = train(preset, contextlib.nullcontext)
    for p, q in zip(on_two, on_one):  # per-stream tables change nothing in the arithmetic
        assert torch.equal(p, q)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("preset", ["bf16w-4bit-lean", "bf16w-4bit-lean-offload"])
def test_release_on_a_side_stream_equals_one_stream(preset, monkeypatch):
    """Real streams: released updates on a side stream (as FSDP2's post-reduce stream), the caches
    clearing within every step; the same bits as on one stream, and each stream has its own tables."""
    monkeypatch.setattr(launch, "MAX_CACHED_TABLES", 4)
    side = torch.cuda.Stream()

    @contextlib.contextmanager
    def on_side():
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            yield
        torch.cuda.current_stream().wait_stream(side)

    launch.clear_caches()
    on_two = train(preset, on_side)
    launch.clear_caches()
    on_one = train(preset, contextlib.nullcontext)
    for p, q in zip(on_two, on_one):
        assert torch.equal(p, q)
    device = torch.device("cuda", torch.cuda.current_device())
    here = launch.cached_table([11, 22, 33], device)
    with torch.cuda.stream(side):
        assert launch.stream_key(device) == side.cuda_stream
        there = launch.cached_table([11, 22, 33], device)
        assert launch.cached_table([11, 22, 33], device) is there
    assert there.data_ptr() != here.data_ptr() and torch.equal(here, there)
    assert launch.cached_table([11, 22, 33], device) is here
