"""tools/fsdp_dcp_resume.py's determinism helpers: checksums that locate a difference, element-level
descriptions, the per-layer census and the --delay specs (the GPU runs are in docs/benchmarks-journal.md 36)."""
import os

import pytest
import torch

from helpers import load_tool

_ALLOC_CONF = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
tool = load_tool("fsdp_dcp_resume")  # (sets the pinned-allocator variable for its own runs)
if _ALLOC_CONF is None:  # other tests' subprocesses must not inherit the tool's setting
    os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)


def test_block_sums_locate_the_changed_block_only():
    t = torch.randn((2 * tool.BLOCK + 100) // 4)  # three 64 KiB blocks, the last one partial
    before = tool.block_sums(t, "cpu")
    assert before.shape == (3,)
    t[tool.BLOCK // 4 + 1] += 1.0  # a float in the second block
    after = tool.block_sums(t, "cpu")
    assert (before != after).tolist() == [False, True, False]
    assert tool.diverged({"x": before, "y": before}, {"x": after, "y": before.clone()}) == ["x"]
    assert tool.diverged({"x": before}, {"z": before}) == ["x", "z"]


def test_block_sums_see_swapped_bytes():
    t = torch.arange(256, dtype=torch.uint8)
    swapped = t.clone()
    swapped[[3, 4]] = swapped[[4, 3]]
    assert not torch.equal(tool.block_sums(t, "cpu"), tool.block_sums(swapped, "cpu"))


def test_describe_counts_bits_and_shows_a_uniform_rescale():
    a = torch.randn(1000)
    b = a.clone()
    b[600:] *= 0.9
    d = tool.describe(a, b, "cpu")
    assert (d["differ"], d["first"], d["last"]) == (400, 600, 999)
    assert d["ratio_median"] == pytest.approx(0.9, rel=1e-6)
    assert d["pairs"][0][0] == 600
    nan = torch.tensor([float("nan"), 1.0])
    assert tool.describe(nan, nan.clone(), "cpu")["differ"] == 0  # bits, not values: NaN equals its copy
    codes = torch.tensor([1, 2, 3], dtype=torch.uint8)
    assert tool.describe(codes, torch.tensor([1, 7, 3], dtype=torch.uint8), "cpu")["pairs"] == [(1, 2, 7)]


def test_layers_of_counts_names_per_decoder_layer():
    names = ["param.model.layers.10.mlp.up_proj.weight", "state.model.layers.2.self_attn.q_proj.weight.exp_avg",
             "param.model.layers.2.mlp.down_proj.weight", "param.lm_head.weight"]
    assert tool.layers_of(names) == {"2": 2, "10": 1, "other": 1}


def test_delay_specs_are_parsed_or_refused_by_name():
    assert tool.parse_delay("d2h=2e7+compute=1000") == {"d2h": 20_000_000, "compute": 1000}
    for bad in ("d2h", "gpu=5", "h2d=5+x=1"):
        with pytest.raises(ValueError, match="--delay"):
            tool.parse_delay(bad)
