"""optstate_lightning under DDP: 2 CPU processes (gloo), strategy by name, AdaptiveWarmupPolicy
switching at the same step on every rank although the ranks see different data and losses."""
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lightning")

import torch  # noqa: E402

import optstate_core as oc  # noqa: E402
from lightning_ddp_job import PATIENCE, TOL  # noqa: E402
from lightning_helpers import trainer  # noqa: E402
from optstate_lightning import OptStateCallback, OptStateDDPStrategy  # noqa: E402

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def first_switch(losses):
    policy = oc.AdaptiveWarmupPolicy(warmup_steps=10_000, patience=PATIENCE, tol=TOL)
    return next((i + 1 for i, loss in enumerate(losses) if policy.observe_loss(loss)), None)


@pytest.mark.timeout(240)
def test_ddp_ranks_switch_together_and_stay_identical(tmp_path):
    """DistributedSampler gives rank 0 the even samples (learnable targets) and rank 1 the odd
    ones (pure-noise targets), so the ranks' losses differ. Each rank alone would switch
    compression at a different step; with the all-reduced signal both switch at the same step,
    the one the ranks' mean loss gives, and DDP keeps their parameters identical."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), str(ROOT), str(ROOT / "integrations")]))
    for key in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    job = subprocess.run([sys.executable, str(HERE / "lightning_ddp_job.py"), str(tmp_path)], env=env,
                         capture_output=True, text=True, timeout=230)
    assert job.returncode == 0, job.stderr[-3000:]

    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    assert all(r["wrapped"] == "VirtualOptimizer" and r["step_count"] == 12 for r in ranks)
    alone = [first_switch(r["step_losses"]) for r in ranks]  # each rank on its own loss
    assert alone[0] != alone[1], alone
    together = [r["switch_steps"][0] for r in ranks]
    mean_losses = [(a + b) / 2 for a, b in zip(ranks[0]["step_losses"], ranks[1]["step_losses"])]
    assert together[0] == together[1] == first_switch(mean_losses) is not None
    assert torch.equal(ranks[0]["params"], ranks[1]["params"])


def test_spawned_trainer_parts_pickle():
    """ddp_spawn pickles the Trainer with its strategy and callbacks (classes built by the factory)."""
    cb = OptStateCallback(policy=oc.AdaptiveWarmupPolicy(patience=3), chunk_bytes="8MB")
    tr = trainer(strategy="optstate_ddp_spawn", devices=2, callbacks=[cb])
    assert isinstance(tr.strategy, OptStateDDPStrategy) and tr.strategy._start_method == "spawn"
    strategy, callback = pickle.loads(pickle.dumps((tr.strategy, cb)))
    assert type(strategy) is OptStateDDPStrategy and type(callback) is OptStateCallback
    assert callback.config.policy.patience == 3 and callback.config.wrap_options == {"chunk_bytes": "8MB"}
    assert callback.optimizers == [] and strategy._optstate_callback.config.policy is None
