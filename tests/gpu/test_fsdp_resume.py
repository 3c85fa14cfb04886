"""FSDP2 + DCP resume on 2 GPUs (NCCL), fused path: a run saved with DCP after 10 steps and resumed
into a fresh model and optimizer (which had trained other steps) continues bit for bit like the
uninterrupted run, for `8bit`, `4bit`, the lean preset with gradient release and its offloaded form
(moments and correction of every shard in host memory; skipped with fewer than 2 GPUs)."""
import os
import sys

import pytest
import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")]


def test_fsdp2_dcp_resume_is_bit_identical_for_every_preset(tmp_path):
    import fsdp_resume_job
    mp.spawn(fsdp_resume_job.job, args=(2, str(tmp_path)), nprocs=2, join=True)
    out = torch.load(tmp_path / "fsdp_resume.pt", weights_only=False)
    assert set(out) == {"8bit", "4bit", "bf16w-4bit-lean+release", "4bit+release", "bf16w-4bit-lean-offload+release"}
    for tag, r in out.items():
        assert r["differing_state"] == [], (tag, r)  # DCP brought back every state word
        assert r["fused_first"], (tag, r)
        assert r["equal"], (tag, r)
