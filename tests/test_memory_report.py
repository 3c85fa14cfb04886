"""Persistent state size, measured through memory_report on >= 25M parameters in Llama-1B-like shapes."""
import pytest
import torch

import optstate_core as oc

# Llama-1B-like shapes at a quarter of the rows: an 8000x2048 embedding and three 1408x2048 MLP
# matrices, 25.0M params (the block scales' share of bits/param does not depend on the count; the
# two fp32 norms add 0.01 bits/param here, 0.003 at 100M)
SHAPES = [(8000, 2048), (1408, 2048), (1408, 2048), (1408, 2048), (2048,), (2048,)]


@pytest.fixture(scope="module")
def params():
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(s) * 0.02) for s in SHAPES]
    for p in ps:
        p.grad = torch.randn_like(p) * 1e-3
    assert sum(p.numel() for p in ps) >= 25_000_000
    return ps


@pytest.mark.slow
@pytest.mark.parametrize("preset,limit", [("8bit", 16.3), ("4bit", 8.6)])
def test_bits_per_param_on_25m_parameters(params, preset, limit):
    opt = oc.wrap(torch.optim.AdamW(params), preset, chunk_bytes="256MB")
    opt.step()
    report = opt.memory_report()
    assert report["n_params"] >= 25_000_000
    assert report["bits_per_param"] <= limit
    assert report["host_bytes"] == 0 and report["state_bytes"] == report["device_bytes"]
    # the two 2048-element norms stay fp32 (below min_int8_elements): 2 x 2 x 2048 x 4 bytes
    assert report["by_codec"]["fp32"] == 2 * 2 * 2048 * 4
    del opt
