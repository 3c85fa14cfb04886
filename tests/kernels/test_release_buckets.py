"""Gradient release keeps each fused parameter's one-parameter bucket from step to step; whatever
changes the state, its form or the hyper-parameters must not reuse a stale one.

Each run is compared bit for bit with the same run without release (step() after backward).
"""
import copy

import pytest
import torch

import optstate_core as oc
from optstate_core.state.master_weights import cast_model

pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = [(16, 256), (300,), (4, 512)]


def model():
    g = torch.Generator().manual_seed(0)
    m = torch.nn.ParameterList([torch.nn.Parameter((torch.randn(s, generator=g) * 0.5).to(DEVICE)) for s in SHAPES])
    cast_model(m)
    return list(m.parameters())


def step(ps, opt, s, release):
    g = torch.Generator().manual_seed(100 + s)
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g).to(DEVICE, torch.bfloat16)
    if release:
        for p in reversed(ps):  # what the post-accumulate-grad hooks do, in backward order
            opt._engine.schedule.gradient_ready(p)
    opt.step()


def lr_change(ps, opt):
    opt.param_groups[0]["lr"] = 3e-3
    return ps, opt


def reload_checkpoint(ps, opt):
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    return ps, opt


def offload(ps, opt):
    opt.offload()
    return ps, opt


def deepcopy(ps, opt):
    return copy.deepcopy((ps, opt))


@pytest.mark.parametrize("change", [lr_change, reload_checkpoint, offload, deepcopy])
@pytest.mark.parametrize("bucket", [0, None], ids=["per-parameter", "batched"])
def test_kept_buckets_follow_changes(change, bucket):
    """Kept per parameter (``release_bucket_bytes=0``) or per batch of released parameters (the
    default: the three here are one batch)."""
    batches = len(SHAPES) if bucket == 0 else 1
    results = []
    for release in (False, True):
        ps = model()
        options = {"release_bucket_bytes": bucket} if release and bucket is not None else {}
        opt = oc.wrap(torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1), "bf16w-4bit-lean", fused=True,
                      release_gradients=release, **options)
        for s in range(2):
            step(ps, opt, s, release)
        kept = dict(opt._engine.clip_release._buckets)
        if release:
            assert len(kept) == batches  # every batch's buckets are kept after its first release
        ps, opt = change(ps, opt)
        for s in range(2, 4):
            step(ps, opt, s, release)
        if release and change is not lr_change:  # new state objects (or a copy): buckets rebuilt
            now = opt._engine.clip_release._buckets
            assert len(now) == batches and all(now[k][0] is not kept.get(k, (None,))[0] for k in now)
        results.append(ps)
    for p, q in zip(*results):
        assert torch.equal(p, q)


@pytest.mark.parametrize("preset", ["8bit", "4bit", "bf16w-4bit-lean"])
def test_release_equals_step_with_biases_and_norms(preset):
    """An MLP with biases and a LayerNorm (tensors under 4096 elements keep fp32 state): released,
    each tensor takes the path step() gives it (the small fp32 ones go into the kernels beside the
    compressed ones, not to torch's own step), so parameters and state are equal bit for bit."""
    def build():
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.LayerNorm(256),
                                torch.nn.Linear(256, 64)).to(DEVICE)
        if preset.startswith("bf16w"):
            cast_model(m)
        return m
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(16, 64, generator=gen).to(DEVICE) for _ in range(3)]
    out = []
    for release in (False, True):
        m = build()
        opt = oc.wrap(torch.optim.AdamW(m.parameters(), lr=1e-3), preset, fused=True, release_gradients=release)
        for x in xs:
            m(x.to(next(m.parameters()).dtype)).float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        out.append((m, opt))
    (m0, o0), (m1, o1) = out
    assert o0.last_step_timings["fused_params"] == len(list(m0.parameters()))  # every tensor in the kernels
    for p, q in zip(m0.parameters(), m1.parameters()):
        assert torch.equal(p, q)
        for key, value in o0.state[p].items():
            other = o1.state[q][key]
            if isinstance(value, oc.EncodedTensor):
                assert all(torch.equal(value.payload[k], other.payload[k]) for k in value.payload), key
            else:
                assert torch.equal(torch.as_tensor(value), torch.as_tensor(other)), key
