"""The kernels' TORCH_FUSED arithmetic against torch's own fused Adam/AdamW on a real GPU: fp32
state of a ``fused=True`` optimizer is stepped by our kernel, bit for bit what torch computes
(parameters, both moments, amsgrad's maximum, step counts), and a NaN/inf gradient skips only its
256-element blocks, with no extra pass over the gradients and no host synchronisation."""
import pytest
import torch

import optstate_core as oc
from helpers import capture_step

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SHAPES = [(512, 1024), (4096,), (300, 700), (7,), (3, 5, 257)]
CASES = [
    (torch.optim.AdamW, dict(lr=1e-3)),
    (torch.optim.AdamW, dict(lr=3e-4, weight_decay=0.1, betas=(0.8, 0.95), eps=1e-6)),
    (torch.optim.Adam, dict(lr=1e-2)),
    (torch.optim.AdamW, dict(lr=1e-3, maximize=True, weight_decay=0.0)),
    (torch.optim.AdamW, dict(lr=1e-3, amsgrad=True)),
    (torch.optim.AdamW, dict(lr="tensor")),
]


def pair(cls, kw, seed=0):
    torch.manual_seed(seed)
    ps = [torch.nn.Parameter(torch.randn(s, device="cuda") * torch.exp(torch.randn(s, device="cuda"))) for s in SHAPES]
    qs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    kw = dict(kw)

    def lr():
        return torch.tensor(1e-3, device="cuda") if kw.get("lr") == "tensor" else kw.get("lr", 1e-3)
    opt = oc.wrap(cls(ps, **{**kw, "lr": lr()}, fused=True), "fp32")
    ref = cls(qs, **{**kw, "lr": lr()}, fused=True)
    return ps, qs, opt, ref


def set_grads(ps, qs, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    for p, q in zip(ps, qs):
        grad = torch.randn(p.shape, device="cuda", generator=g) * torch.exp(2 * torch.randn(p.shape, device="cuda",
                                                                                             generator=g))
        p.grad = grad.to(p.dtype)
        q.grad = p.grad.clone()


def assert_identical(ps, qs, opt, ref, where):
    for p, q in zip(ps, qs):
        assert torch.equal(p, q), where
        for key, value in ref.state[q].items():
            assert torch.equal(opt.state[p][key], value), (where, key)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_fp32_state_of_a_fused_optimizer_is_stepped_by_the_kernel_bit_for_bit(case):
    cls, kw = CASES[case]
    ps, qs, opt, ref = pair(cls, kw)
    for s in range(6):
        set_grads(ps, qs, s)
        opt.step()
        ref.step()
        assert opt.last_step_timings["fused_params"] == len(SHAPES)
        assert_identical(ps, qs, opt, ref, s)
    # late steps (bias corrections near 1), from the same state
    for p, q in zip(ps, qs):
        ref.state[q]["step"].fill_(997.0)
        opt.state[p]["step"].fill_(997.0)
    for s in range(6, 9):
        set_grads(ps, qs, s)
        opt.step()
        ref.step()
        assert_identical(ps, qs, opt, ref, s)


def test_a_nonfinite_gradient_skips_its_blocks_only_without_a_sync():
    ps, qs, opt, ref = pair(torch.optim.AdamW, dict(lr=1e-3, weight_decay=0.01))
    set_grads(ps, qs, 0)
    opt.step()
    ref.step()
    set_grads(ps, qs, 1)
    ps[0].grad[3, 300] = float("inf")  # block (row 3, columns 256..511) of the first parameter
    ps[2].grad[0, 0] = float("nan")
    before = [(p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()}) for p in ps]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        opt.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ref.step()
    skipped = {0: (3, slice(256, 512)), 2: (0, slice(0, 256))}
    for i, (p, q) in enumerate(zip(ps, qs)):
        keep = torch.zeros(p.shape, dtype=torch.bool, device="cuda")
        if i in skipped:
            row, cols = skipped[i]
            keep[row, cols] = True
        old_p, old_state = before[i]
        for new, old, torch_value in [(p, old_p, q)] + [(opt.state[p][k], old_state[k], ref.state[q][k])
                                                        for k in ("exp_avg", "exp_avg_sq")]:
            assert torch.equal(new[keep], old[keep]), i  # the skipped block is untouched
            assert torch.equal(new[~keep], torch_value[~keep]), i  # everything else is torch's step
        assert float(opt.state[p]["step"]) == float(ref.state[q]["step"]) == 2.0
    assert opt.memory_report()["nonfinite_skipped"] == 2


def test_adam_with_l2_decay_and_bf16_parameters_stay_with_torch():
    """Adam's L2 decay (not reproduced bit for bit) and bf16 parameters are stepped by torch's
    own fused kernel (the passthrough), bit-identical as before."""
    for cls, kw, dtype in ((torch.optim.Adam, dict(lr=1e-3, weight_decay=0.01), torch.float32),
                           (torch.optim.AdamW, dict(lr=1e-3), torch.bfloat16)):
        torch.manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(s, device="cuda").to(dtype)) for s in SHAPES]
        qs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
        opt = oc.wrap(cls(ps, **kw, fused=True), "fp32")
        ref = cls(qs, **kw, fused=True)
        for s in range(3):
            set_grads(ps, qs, s)
            opt.step()
            ref.step()
            assert opt.last_step_timings["fused_params"] == 0
            assert_identical(ps, qs, opt, ref, s)


def test_a_captured_step_replays_torch_fused_adamw_bit_for_bit():
    """The fp32 kernel path (bias corrections from torch's pow on the device, the Triton launches) is
    captured in a CUDA graph; each replay equals an eager step of torch's own fused AdamW."""
    kw = dict(lr=torch.tensor(1e-3, device="cuda"), capturable=True, weight_decay=0.05)
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(s, device="cuda")) for s in SHAPES]
    qs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    opt = oc.wrap(torch.optim.AdamW(ps, **kw, fused=True), "fp32")
    ref = torch.optim.AdamW(qs, **kw, fused=True)
    set_grads(ps, qs, 0)
    for o in (opt, ref):
        o.step()
    graph = capture_step(opt.step, warm=lambda: (opt.step(), ref.step()))  # captured, not run
    assert_identical(ps, qs, opt, ref, "before the replays")
    captured = [p.grad for p in ps]  # the gradient tensors the graph reads
    for s in range(1, 4):
        set_grads(ps, qs, s)
        for p, g in zip(ps, captured):
            g.copy_(p.grad)
            p.grad = g
        graph.replay()
        ref.step()
        torch.cuda.synchronize()
        assert_identical(ps, qs, opt, ref, s)
