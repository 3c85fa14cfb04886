"""optstate under Accelerate's FSDP2 plugin: 2 CPU processes (gloo) started by ``accelerate launch``.

Accelerate selects FSDP only on accelerator devices (see docs/distributed.md); the worker switches
its state to FSDP after construction, so Accelerate's own FSDP2 prepare, clip_grad_norm_,
save_state and load_state (sharded DCP) run on gloo.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

accelerate = pytest.importorskip("accelerate")
from accelerate.utils import FullyShardedDataParallelPlugin  # noqa: E402

if "fsdp_version" not in FullyShardedDataParallelPlugin.__dataclass_fields__:
    pytest.skip(f"accelerate {accelerate.__version__} has no FSDP2 plugin (FullyShardedDataParallelPlugin has no "
                "fsdp_version); FSDP2 through Accelerate needs a newer accelerate", allow_module_level=True)

from test_accelerate_ddp import free_port  # noqa: E402

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "accelerate_fsdp2_worker.py")


def launch(mode, tmp_path, device="cpu"):
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           "--main_process_port", str(free_port()), WORKER, mode, str(tmp_path), device]
    env = dict(os.environ, HF_HOME=str(tmp_path / "hf"), OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=str(tmp_path))
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    return json.loads((tmp_path / f"{mode}.json").read_text())


def test_fsdp2_plugin_trains_shards_state_and_resumes_exactly(tmp_path):
    full = launch("full", tmp_path)
    assert full["sharded"] and full["steps"] == [6.0, 6.0]  # 12 micro-batches, accumulation 2
    # each rank holds half of the single-process state (int8 row shards; 1-D tensors stay fp32)
    single = full["state_bytes_single"]
    assert all(b < 0.55 * single for b in full["state_bytes_per_rank"])
    assert sum(full["state_bytes_per_rank"]) == pytest.approx(single, rel=0.02)
    # accumulation and clipping: the same global norms and parameters as one process on all data,
    # up to summation order (the reduce-scatter adds in another order; a last-bit difference can
    # flip a stochastic-rounding decision of the int8 state, which later steps carry on): a wrong
    # accumulation or clipping would be off by whole factors
    assert full["norms"] == pytest.approx(full["ref_norms"], rel=1e-4)
    assert sum(n > 0.3 for n in full["ref_norms"]) >= 2
    # parameters: within half an lr step (1e-2) of the one-process run; a flipped rounding decision
    # moves an element by a fraction of a step (measured 8e-4 with the current rounding stream)
    assert full["moved"] > 1e-2 and full["max_diff_from_reference"] < 5e-3, full

    resumed = launch("resume", tmp_path)
    assert resumed["loaded_step"] == 3 and resumed["steps"] == [6.0, 6.0]
    assert resumed["norms"] == full["norms"][3:]
    for rank in (0, 1):
        a = torch.load(tmp_path / f"full_rank{rank}.pt", weights_only=True)
        b = torch.load(tmp_path / f"resume_rank{rank}.pt", weights_only=True)
        assert torch.equal(a["params"], b["params"]) and a["step"] == b["step"] == 6
        assert a["state"].keys() == b["state"].keys() and a["state"]
        for key in a["state"]:
            assert torch.equal(a["state"][key], b["state"][key]), key


def test_gradient_release_follows_the_parameters_fsdp2_prepare_swaps_in(tmp_path):
    """The optimizer is wrapped before prepare() shards the model (as the HF Trainer does too):
    attach() moves release's hooks to the DTensor shards, so each boundary micro-batch's gradients
    are applied and freed in backward (none left for step()), the norm's group is the mesh's, and
    training matches one process on all data."""
    out = launch("release", tmp_path)
    assert out["steps"] == 6 and out["group_size"] == 2
    assert out["released"] == [out["params"]] * 6 and out["grads_left"] == [0] * 6
    assert out["moved"] > 1e-2 and out["max_diff_from_reference"] < 5e-3, out
