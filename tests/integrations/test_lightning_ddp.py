"""optstate_lightning under DDP: 2 CPU processes (gloo), strategy by name, AdaptiveWarmupPolicy
switching at the same step on every rank although the ranks see different data and losses."""
import pytest

pytest.importorskip("lightning")

import torch  # noqa: E402

import optstate_core as oc  # noqa: E402
from lightning_helpers import Regressor, loader, trainer  # noqa: E402
from optstate_lightning import OptStateCallback, OptStateDDPStrategy  # noqa: E402

PATIENCE, TOL = 2, 0.05


def first_switch(losses):
    policy = oc.AdaptiveWarmupPolicy(warmup_steps=10_000, patience=PATIENCE, tol=TOL)
    return next((i + 1 for i, loss in enumerate(losses) if policy.observe_loss(loss)), None)


@pytest.mark.timeout(180)
def test_ddp_ranks_switch_together_and_stay_identical(tmp_path):
    """DistributedSampler gives rank 0 the even samples (learnable targets) and rank 1 the odd
    ones (pure-noise targets): rank 1's loss stalls at once, rank 0's keeps falling. Each rank
    alone would switch compression at a different step; with the all-reduced signal both switch
    at the same step, and DDP keeps their parameters identical."""
    policy = oc.AdaptiveWarmupPolicy(warmup_steps=10_000, patience=PATIENCE, tol=TOL, momentum_codec="int8",
                                     variance_codec="int8", min_int8_elements=0)
    model = Regressor(lr=1e-2, out_dir=str(tmp_path))
    tr = trainer(strategy="optstate_ddp_spawn", devices=2, accumulate_grad_batches=2, max_epochs=3,
                 callbacks=[OptStateCallback(policy=policy)])  # the strategy uses the Trainer's callback
    assert isinstance(tr.strategy, OptStateDDPStrategy)
    tr.fit(model, loader(n=128, noisy_odd=True))  # 64 samples per rank: 8 batches, 4 steps per epoch

    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    assert all(r["wrapped"] == "VirtualOptimizer" and r["step_count"] == 12 for r in ranks)
    # what each rank would have done on its own loss
    alone = [first_switch(r["step_losses"]) for r in ranks]
    assert alone[0] != alone[1], alone
    # what the ranks did: the same step, the one the mean of the ranks' losses gives
    together = [r["switch_steps"][0] for r in ranks]
    mean_losses = [(a + b) / 2 for a, b in zip(ranks[0]["step_losses"], ranks[1]["step_losses"])]
    assert together[0] == together[1] == first_switch(mean_losses) is not None
    assert torch.equal(ranks[0]["params"], ranks[1]["params"])
