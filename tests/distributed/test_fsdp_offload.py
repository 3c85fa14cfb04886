"""FSDP2 with offloaded state: the post-accumulate-grad hooks that FSDP2 calls on the sharded
parameters after each reduce-scatter stage the local shards' state during backward (only on the
micro-batch that ends a window), and the result equals resident state bit for bit."""
import os
import sys

import pytest
import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(__file__))
import offload_jobs  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")


def test_fsdp2_offloaded_state_uploads_in_backward_and_matches_resident(tmp_path):
    mp.spawn(offload_jobs.fsdp_offload_job, args=(2, str(tmp_path)), nprocs=2, join=True)
    out = torch.load(tmp_path / "offload_result.pt", weights_only=False)
    assert out["interpreted"]  # the fused path (and so the step schedule) ran on the CPU
    assert out["params_equal"] and out["states_equal"]
    assert all(b > 0 for b in out["staged"][2:]), out["staged"]  # from the third step (cached plan, hooks) on
