"""``model.to("cuda")`` after wrapping on the CPU: the state follows the parameters to the GPU in its
codec (offloaded state stays on the host) and training continues as it would have on the CPU."""
import copy

import pytest
import torch

import optstate_core as oc

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
LR = 1e-2


def train(model, opt, steps, first):
    device = next(model.parameters()).device
    for s in range(first, first + steps):
        g = torch.Generator().manual_seed(s)
        x, y = torch.randn(16, 32, generator=g), torch.randint(0, 8, (16,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x.to(device)), y.to(device)).backward()
        opt.step()


@pytest.mark.parametrize("preset", ["fp32", "8bit", "4bit", "offload"])
def test_state_follows_model_to_cuda(preset):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.GELU(), torch.nn.Linear(128, 8))
    opt = oc.wrap(torch.optim.AdamW(model.parameters(), lr=LR), preset)
    train(model, opt, 2, first=0)
    cpu_model, cpu_opt = copy.deepcopy((model, opt))
    model.cuda()
    train(model, opt, 2, first=2)
    train(cpu_model, cpu_opt, 2, first=2)
    for p in model.parameters():
        assert p.is_cuda
        for key, value in opt.state[p].items():
            if isinstance(value, oc.EncodedTensor):
                assert value.device.type == ("cpu" if value.host_tier else "cuda"), key
                assert value.dtype == p.dtype
            elif key != "step":
                assert value.is_cuda, key
    got = torch.cat([p.detach().cpu().reshape(-1) for p in model.parameters()])
    ref = torch.cat([p.detach().reshape(-1) for p in cpu_model.parameters()])
    diff = (got - ref).abs()
    # fp32 round-off (CUDA vs CPU math, fused vs reference), except where it moved a code by one
    # step (at most 1/7 of a 4-bit block's range): those elements stay within half an update
    assert diff.max() <= 0.5 * LR
    assert (diff <= 1e-5).float().mean() >= 0.99
