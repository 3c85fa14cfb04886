"""A 2-process CPU (gloo) DDP job for test_lightning_ddp.py: ``python lightning_ddp_job.py OUT_DIR``.

``strategy="optstate_ddp"`` relaunches this script for rank 1 (Lightning's popen launcher, as
for ``strategy="ddp"``); each rank writes what it saw to OUT_DIR/rank<r>.pt at the end of fit.
"""
import sys

import optstate_core as oc
from job_exit import end_rank
from lightning_helpers import Regressor, loader, trainer
from optstate_lightning import OptStateCallback, OptStateDDPStrategy

PATIENCE, TOL = 2, 0.05


def main(out_dir: str) -> None:
    policy = oc.AdaptiveWarmupPolicy(warmup_steps=10_000, patience=PATIENCE, tol=TOL, momentum_codec="int8",
                                     variance_codec="int8", min_int8_elements=0, whole_blocks_1d=False)
    model = Regressor(lr=1e-2, out_dir=out_dir)
    tr = trainer(strategy="optstate_ddp", devices=2, accumulate_grad_batches=2, max_epochs=3,
                 callbacks=[OptStateCallback(policy=policy)])  # the strategy uses the Trainer's callback
    assert isinstance(tr.strategy, OptStateDDPStrategy)
    tr.fit(model, loader(n=128, noisy_odd=True))  # 64 samples per rank: 8 batches, 4 steps per epoch
    end_rank()


if __name__ == "__main__":
    main(sys.argv[1])
