"""The HF Trainer with FSDP2 and optim="optstate_adamw_8bit": 2 CPU processes (gloo) started by
``accelerate launch``; see hf_fsdp2_worker.py for how FSDP is reached on CPU."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

accelerate = pytest.importorskip("accelerate")
from accelerate.utils import FullyShardedDataParallelPlugin  # noqa: E402

if "fsdp_version" not in FullyShardedDataParallelPlugin.__dataclass_fields__:
    pytest.skip(f"accelerate {accelerate.__version__} has no FSDP2 plugin (FullyShardedDataParallelPlugin has no "
                "fsdp_version)", allow_module_level=True)

import optstate_hf  # noqa: E402
from hf_fsdp2_worker import STEPS, fsdp_overrides  # noqa: E402
from hf_testlib import flat_params, make_trainer, one_thread  # noqa: E402,F401
from test_accelerate_ddp import free_port  # noqa: E402

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hf_fsdp2_worker.py")


def launch(phase, tmp_path, device="cpu"):
    tmp_path.mkdir(exist_ok=True)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           "--main_process_port", str(free_port()), WORKER, phase, str(tmp_path), device]
    env = dict(os.environ, HF_HOME=str(tmp_path / "hf"), OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=str(tmp_path))
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    return [torch.load(tmp_path / f"{phase}_rank{r}.pt", weights_only=True) for r in range(2)]


@pytest.mark.usefixtures("one_thread")
def test_trainer_fsdp2_matches_one_process_and_resumes_exactly(tmp_path):
    full = launch("full", tmp_path / "fsdp")
    # one process, no FSDP, twice the per-device batch: the same samples per optimizer step
    overrides = {k: v for k, v in fsdp_overrides("cpu").items() if k not in ("fsdp", "fsdp_config")}
    overrides["per_device_train_batch_size"] *= 2
    single = make_trainer(tmp_path / "single", **overrides)
    single.train()
    opt = optstate_hf.find_virtual_optimizer(single.optimizer)
    ref_norms = [h["grad_norm"] for h in single.state.log_history if "grad_norm" in h]
    assert len(ref_norms) == STEPS and sum(n > 0.5 for n in ref_norms) >= 2  # clipping is active
    for rank in full:
        assert rank["sharded"] and rank["step_count"] == STEPS == opt.step_count
        assert rank["grad_norms"] == pytest.approx(ref_norms, rel=1e-3)  # int8 near-ties may round apart
        # the same math up to float summation order (reduce-scatter vs one batch), which AdamW's
        # normalisation amplifies for elements with tiny gradients: within a fraction of one lr step
        assert (rank["params"] - flat_params(single.model)).abs().max() < 0.5 * overrides["learning_rate"]
        assert rank["state_bytes"] < 0.55 * opt.memory_report()["state_bytes"]

    resumed = launch("resume", tmp_path / "fsdp")
    assert (tmp_path / "fsdp" / "checkpoint-3" / "optimizer_0").is_dir()  # sharded (DCP) optimizer checkpoint
    for a, b in zip(full, resumed):
        assert b["step_count"] == STEPS and b["grad_norms"] == a["grad_norms"]
        assert torch.equal(a["params"], b["params"])
        assert a["state"].keys() == b["state"].keys() and a["state"]
        for key in a["state"]:
            assert torch.equal(a["state"][key], b["state"][key]), key


@pytest.mark.usefixtures("one_thread")
def test_trainer_fsdp2_releases_gradients_from_the_first_step(tmp_path):
    """optim_args="release_gradients=true" under the Trainer's FSDP2: the optimizer exists before the
    Trainer shards the model; OptStateCallback moves release's hooks to the DTensor parameters, so on
    every step backward has applied and freed every gradient before step()."""
    for rank in launch("release", tmp_path / "release"):
        assert rank["sharded"] and rank["step_count"] == STEPS
        assert rank["released"] == [rank["n_params"]] * STEPS and rank["grads_left"] == [0] * STEPS
        assert len(rank["losses"]) == STEPS and rank["losses"][-1] < rank["losses"][0]
        assert len(rank["grad_norms"]) == STEPS and all(n > 0 for n in rank["grad_norms"])  # the optimizer's norm


@pytest.mark.usefixtures("one_thread")
def test_trainer_fsdp2_release_without_passing_the_callback(tmp_path):
    """As above with no callback passed: the Trainer that creates the optimizer from the optim name gets
    OptStateCallback, which rebinds release to the sharded parameters at on_train_begin."""
    for rank in launch("release_auto", tmp_path / "release_auto"):
        assert rank["callbacks"].count("OptStateCallback") == 1
        assert rank["sharded"] and rank["step_count"] == STEPS
        assert rank["released"] == [rank["n_params"]] * STEPS and rank["grads_left"] == [0] * STEPS
        assert len(rank["grad_norms"]) == STEPS and all(n > 0 for n in rank["grad_norms"])
