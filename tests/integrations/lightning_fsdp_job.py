"""A 2-process CPU (gloo) FSDP2 job for test_lightning_fsdp.py:
``python lightning_fsdp_job.py STRATEGY PHASE OUT_DIR`` with STRATEGY ``model_parallel`` (Lightning's
``ModelParallelStrategy``, FSDP2 ``fully_shard`` in ``configure_model``) and PHASE ``full`` (2 epochs of
3 steps, a checkpoint at the end of the first) or ``resume`` (``fit(ckpt_path=<that checkpoint>)``).
Checkpoints are taken at an epoch end: Lightning restarts an interrupted epoch's data from its start.

Lightning's popen launcher relaunches this script for rank 1. Each rank writes OUT_DIR/<phase>_rank<r>.pt:
the full parameters, its local optimizer state, state bytes and the gradient norms it clipped.
A 4th argument ``cuda`` runs it on 2 GPUs (NCCL).
"""
import os
import sys

import torch
from lightning.pytorch.callbacks import ModelCheckpoint

sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, for helpers
import optstate_core as oc  # noqa: E402
from helpers import local_tensors  # noqa: E402
from job_exit import end_rank  # noqa: E402
from lightning_helpers import Regressor, loader, trainer  # noqa: E402
from optstate_lightning import OptStateCallback  # noqa: E402

ACCUM, EPOCHS, CLIP, N = 2, 2, 0.5, 96  # 48 samples per rank: 6 batches of 8, 3 steps per epoch


class ShardedRegressor(Regressor):
    def __init__(self, out_dir, phase):
        super().__init__(lr=1e-2)
        self.out_path = os.path.join(out_dir, f"{phase}_rank{{}}.pt")
        self.norms = []

    def configure_model(self):
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        # record the global norm (max_norm=inf scales by exactly 1), then Lightning's own clipping
        params = [p for g in optimizer.param_groups for p in g["params"]]
        self.norms.append(float(torch.nn.utils.clip_grad_norm_(params, float("inf"))))
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def on_fit_end(self):
        opt = self.trainer.optimizers[0]
        params = torch.cat([p.full_tensor().detach().cpu().reshape(-1) for p in self.parameters()])
        sharded = all(type(p).__name__ == "DTensor" for p in self.parameters())
        torch.save({"params": params, "state": local_tensors(opt.state_dict()), "step_count": opt.step_count,
                    "wrapped": type(opt).__name__, "sharded": sharded,
                    "state_bytes": opt.memory_report()["state_bytes"], "norms": self.norms},
                   self.out_path.format(self.global_rank))


def main(strategy_name: str, phase: str, out_dir: str, device: str = "cpu") -> None:
    from lightning.pytorch.strategies import ModelParallelStrategy

    assert strategy_name == "model_parallel", strategy_name
    strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    callbacks = [OptStateCallback(policy=oc.make_policy("8bit", min_int8_elements=256))]
    if phase == "full":
        callbacks.append(ModelCheckpoint(dirpath=os.path.join(out_dir, "ckpt"), every_n_epochs=1, save_top_k=-1,
                                         filename="{epoch}"))
    tr = trainer(strategy=strategy, devices=2, accelerator=device, accumulate_grad_batches=ACCUM, max_epochs=EPOCHS,
                 gradient_clip_val=CLIP, enable_checkpointing=phase == "full", callbacks=callbacks)
    model = ShardedRegressor(out_dir, phase)
    ckpt = os.path.join(out_dir, "ckpt", "epoch=0.ckpt") if phase == "resume" else None
    tr.fit(model, loader(n=N), ckpt_path=ckpt)
    end_rank()


if __name__ == "__main__":
    main(*sys.argv[1:])
