"""FSDP2 through Accelerate, the HF Trainer and Lightning on 2 GPUs with NCCL (skipped with fewer).

The same workers as the CPU tests in tests/integrations (which reach FSDP on gloo by switching
Accelerate's state, or through Lightning's ModelParallelStrategy), here with nothing switched:

    python -m pytest -m gpu tests/gpu/test_fsdp_frameworks.py -v    # or tools/fsdp_frameworks_gpu.sh
"""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "integrations"))

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")]


def assert_same_ranks(full, resumed, steps):
    for a, b in zip(full, resumed):
        assert b["step_count"] == steps
        assert torch.equal(a["params"], b["params"])
        assert a["state"].keys() == b["state"].keys() and a["state"]
        for key in a["state"]:
            assert torch.equal(a["state"][key], b["state"][key]), key


def test_accelerate_fsdp2_plugin_on_gpus(tmp_path):
    pytest.importorskip("accelerate")
    from test_accelerate_fsdp2 import launch

    full = launch("full", tmp_path, "cuda")
    assert full["sharded"] and full["steps"] == [6.0, 6.0]
    assert all(b < 0.55 * full["state_bytes_single"] for b in full["state_bytes_per_rank"])
    assert full["norms"] == pytest.approx(full["ref_norms"], rel=1e-3)  # the reference ran on the CPU
    assert full["max_diff_from_reference"] < 1e-3
    resumed = launch("resume", tmp_path, "cuda")
    assert resumed["loaded_step"] == 3 and resumed["norms"] == full["norms"][3:]
    a = [torch.load(tmp_path / f"full_rank{r}.pt", weights_only=True) for r in range(2)]
    b = [torch.load(tmp_path / f"resume_rank{r}.pt", weights_only=True) for r in range(2)]
    for x in a + b:
        x["step_count"] = x["step"]
    assert_same_ranks(a, b, 6)


def test_hf_trainer_fsdp2_on_gpus(tmp_path):
    pytest.importorskip("transformers")
    from test_hf_fsdp2 import launch

    full = launch("full", tmp_path, "cuda")
    assert all(r["sharded"] and r["step_count"] == 6 for r in full)
    assert full[0]["grad_norms"] == pytest.approx(full[1]["grad_norms"])
    resumed = launch("resume", tmp_path, "cuda")
    assert_same_ranks(full, resumed, 6)


def test_lightning_model_parallel_on_gpus(tmp_path):
    pytest.importorskip("lightning")
    from test_lightning_fsdp import run_job

    full = run_job("full", tmp_path, "cuda")
    assert all(r["wrapped"] == "VirtualOptimizer" and r["sharded"] and r["step_count"] == 6 for r in full)
    resumed = run_job("resume", tmp_path, "cuda")
    for a, b in zip(full, resumed):
        assert b["norms"] == a["norms"][3:]
    assert_same_ranks(full, resumed, 6)
