"""The Adam kernel's master-weight path (bf16 parameter + correction, one pass) against the
reference path (join -> torch AdamW in fp32 -> split -> encode).

Bound: the fp32 masters agree within fp32 round-off of the update (|diff| <= 1e-6 + 1e-6 |x|;
with corr8, where round-off may move the master across a correction code, 1e-6 + 2**-14 |x|),
so bf16 parameters agree except where round-off crosses a bf16 rounding boundary (<= 0.5% of
elements, one bf16 ulp); the corrections are what make the masters agree (checked through them).
"""
import copy

import pytest
import torch

import optstate_core as oc
from helpers import bf16_param_list
from optstate_core.state.master_weights import MASTER_KEY, join

pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = [(24, 700), (257,), (3, 256), (6, 130)]


def model(seed=0):
    return bf16_param_list(SHAPES, seed, DEVICE)


def set_grads(ps, seed):
    g = torch.Generator().manual_seed(1000 + seed)
    for p in ps:
        p.grad = (torch.randn(p.shape, generator=g) * torch.exp(torch.randn(p.shape, generator=g))).to(DEVICE, p.dtype)


def masters(opt, ps):
    return [join(p.detach(), opt.state[p][MASTER_KEY].decode()) for p in ps]


@pytest.mark.parametrize("preset,moments", [("bf16w-8bit", "fp32"), ("bf16w-8bit", None),
                                            ("bf16w-4bit-lean", None)])
def test_master_weight_kernel_matches_reference(preset, moments):
    overrides = dict(min_int8_elements=0, whole_blocks_1d=False)
    if moments:
        overrides.update(momentum_codec=moments, variance_codec=moments)
    ref_m, m = model(), model()
    ref = oc.wrap(torch.optim.AdamW(ref_m.parameters(), lr=1e-2, weight_decay=0.1),
                  oc.make_policy(preset, **overrides), fused=False)
    opt = oc.wrap(torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1),
                  oc.make_policy(preset, **overrides), fused=True)
    for step in range(3):
        if step:  # compare each step from identical inputs
            with torch.no_grad():
                for p, rp in zip(m.parameters(), ref_m.parameters()):
                    p.copy_(rp)
            opt.load_state_dict(copy.deepcopy(ref.state_dict()))
        set_grads(list(ref_m.parameters()), step)
        set_grads(list(m.parameters()), step)
        ref.step()
        opt.step()
        assert opt.last_step_timings["fused_params"] == len(SHAPES)
        rtol = 1e-6 if preset == "bf16w-8bit" else 2**-14  # corr8: round-off may move one correction code
        for x, rx in zip(masters(opt, list(m.parameters())), masters(ref, list(ref_m.parameters()))):
            torch.testing.assert_close(x, rx, rtol=rtol, atol=1e-6)
        for p, rp in zip(m.parameters(), ref_m.parameters()):
            assert p.dtype == torch.bfloat16
            assert (p != rp).float().mean() <= 0.005
            a, b = opt.state[p][MASTER_KEY], ref.state[rp][MASTER_KEY]
            assert a.codec == b.codec
            assert a.payload["data"].dtype == b.payload["data"].dtype
            for key in ("exp_avg", "exp_avg_sq"):
                assert opt.get_state(p)[key].dtype == torch.float32  # the state follows the fp32 master


def test_master_kernel_first_step_uses_the_cast_remainder_and_skips_nonfinite():
    m = model()
    g = torch.Generator().manual_seed(0)
    fp32_values = [(torch.randn(s, generator=g) * 0.5) for s in SHAPES]
    opt = oc.wrap(torch.optim.AdamW(m.parameters(), lr=0.0, weight_decay=0.0), "bf16w-8bit", fused=True)
    ps = list(m.parameters())
    set_grads(ps, 0)
    ps[1].grad[3] = float("nan")
    before = ps[1].detach().clone()
    opt.step()
    assert opt.last_step_timings["fused_params"] == len(SHAPES)
    for x, want, p in zip(masters(opt, ps), fp32_values, ps):
        if p is ps[1]:
            continue
        assert torch.equal(x, want.to(DEVICE))  # lr 0: the exact fp32 values cast_model took
    assert torch.equal(ps[1], before) and opt.memory_report()["nonfinite_skipped"] == 1


def test_released_gradients_take_the_kernel_too():
    """Gradient release steps the released parameters through the kernels, in their own launches
    (per parameter with ``release_bucket_bytes=0``, else per batch): same result as step()."""
    results = []
    for release, bucket in ((False, None), (True, 0), (True, None)):
        m = model()
        options = {} if bucket is None else {"release_bucket_bytes": bucket}
        opt = oc.wrap(torch.optim.AdamW(m.parameters(), lr=1e-2), "bf16w-4bit-lean", fused=True,
                      release_gradients=release, **options)
        ps = list(m.parameters())
        for step in range(2):
            set_grads(ps, step)
            if release:
                for p in ps:  # what autograd's post-accumulate-grad hooks do
                    opt._engine.schedule.gradient_ready(p)
                    assert (p.grad is None) == (bucket == 0)  # batched: pending until the batch fills
                opt._engine.clip_release.flush()  # and its callback at the end of backward
                assert all(p.grad is None for p in ps)
            opt.step()
        assert opt.last_step_timings["fused_params"] == (0 if release else len(SHAPES))
        results.append((ps, masters(opt, ps)))
    for a, b, c in zip(results[0][1], results[1][1], results[2][1]):
        assert torch.equal(a, b) and torch.equal(a, c)
