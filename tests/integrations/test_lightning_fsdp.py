"""optstate_lightning under Lightning's ModelParallelStrategy (FSDP2): 2 CPU processes (gloo),
accumulation and clipping checked against one process, per-rank state, exact resume from
Lightning's own (distributed) checkpoint."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lightning")

import torch  # noqa: E402
from torch.utils.data import DistributedSampler  # noqa: E402

import optstate_core as oc  # noqa: E402
from lightning_fsdp_job import ACCUM, CLIP, EPOCHS, N  # noqa: E402
from helpers import same_up_to_rounding_flips  # noqa: E402
from lightning_helpers import Regressor, regression_data  # noqa: E402

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def run_job(phase, out_dir, device="cpu"):
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(HERE), str(ROOT), str(ROOT / "integrations")]))
    for key in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    job = subprocess.run([sys.executable, str(HERE / "lightning_fsdp_job.py"), "model_parallel", phase, str(out_dir),
                          device], env=env, capture_output=True, text=True, timeout=230)
    assert job.returncode == 0, job.stderr[-3000:]
    return [torch.load(out_dir / f"{phase}_rank{r}.pt", weights_only=True) for r in range(2)]


def single_process_reference():
    """Each step's gradient: the mean over both ranks' micro-batches, clipped to CLIP, then the
    wrapped AdamW. The ranks' samples are those of the DistributedSampler Lightning puts in
    (it shuffles with seed 0 and the epoch here)."""
    model = Regressor(lr=1e-2)
    opt = oc.wrap(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01),
                  oc.make_policy("8bit", min_int8_elements=256))
    data = regression_data(N)
    x, y = data.tensors
    samplers = [DistributedSampler(data, num_replicas=2, rank=r, shuffle=True, seed=0) for r in range(2)]
    batches = len(samplers[0]) // 8
    norms = []
    for epoch in range(EPOCHS):
        for sampler in samplers:
            sampler.set_epoch(epoch)
        per_rank = [torch.tensor(list(sampler)) for sampler in samplers]
        for step in range(batches // ACCUM):
            for k in range(ACCUM):
                for idx in per_rank:
                    rows = idx[(step * ACCUM + k) * 8:(step * ACCUM + k + 1) * 8]
                    loss = torch.nn.functional.mse_loss(model(x[rows]), y[rows])
                    (loss / (ACCUM * 2)).backward()
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
            opt.step()
            opt.zero_grad()
    return model, opt, norms


@pytest.mark.timeout(300)
def test_model_parallel_strategy_fsdp2(tmp_path):
    full = run_job("full", tmp_path)
    ref_model, ref_opt, ref_norms = single_process_reference()
    ref_params = torch.cat([p.detach().reshape(-1) for p in ref_model.parameters()])
    for rank in full:
        assert rank["wrapped"] == "VirtualOptimizer" and rank["sharded"] and rank["step_count"] == 6
        assert rank["norms"] == pytest.approx(ref_norms, rel=1e-5)
        assert same_up_to_rounding_flips((rank["params"] - ref_params).abs())  # 1 flip seen: 3e-4
        assert rank["state_bytes"] < 0.55 * ref_opt.memory_report()["state_bytes"]
    assert sum(n > CLIP for n in ref_norms) >= 2
    assert sum(r["state_bytes"] for r in full) == pytest.approx(ref_opt.memory_report()["state_bytes"], rel=0.02)

    assert (tmp_path / "ckpt" / "epoch=0.ckpt").is_dir()  # Lightning's distributed (DCP) checkpoint
    resumed = run_job("resume", tmp_path)
    for a, b in zip(full, resumed):
        assert b["step_count"] == 6 and b["norms"] == a["norms"][3:]
        assert torch.equal(a["params"], b["params"])
        assert a["state"].keys() == b["state"].keys() and a["state"]
        for key in a["state"]:
            assert torch.equal(a["state"][key], b["state"][key]), key


def test_fsdp1_strategy_is_refused_with_the_alternative():
    """Lightning's FSDPStrategy (FSDP1, flattened parameters) is refused before anything is wrapped.
    (The Trainer itself refuses FSDPStrategy on CPU, so the callback is called with its parts.)"""
    from types import SimpleNamespace

    from lightning.pytorch.strategies import FSDPStrategy

    from optstate_lightning import OptStateCallback

    inner = torch.optim.AdamW(Regressor().parameters())
    strategy = FSDPStrategy()
    strategy.optimizers = [inner]
    callback = OptStateCallback(policy="8bit")
    fake_trainer = SimpleNamespace(strategy=strategy, callbacks=[callback])
    with pytest.raises(ValueError, match="FSDPStrategy is FSDP1.*ModelParallelStrategy"):
        callback.wrap_optimizers(fake_trainer, None)
    assert strategy.optimizers == [inner] and callback.optimizers == []
