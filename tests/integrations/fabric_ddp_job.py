"""A 2-process CPU (gloo) Lightning Fabric job for test_fabric.py: ``python fabric_ddp_job.py OUT_DIR``.

``Fabric(strategy="ddp")`` relaunches this script for rank 1 (Lightning's popen launcher). Each rank
trains :data:`SAVED_AT` optimizer steps (2 micro-batches each, under ``fabric.no_backward_sync`` and
``set_step_boundary``), saves a checkpoint with ``fabric.save``, trains to :data:`STEPS`; then a fresh
Fabric, model and optimizer (other initial weights) load the checkpoint with ``fabric.load`` and train
the same last steps. Each rank writes both runs' parameters to OUT_DIR/rank<r>.pt.
"""
import sys
from pathlib import Path

import torch
import lightning as L

import optstate_core as oc
from job_exit import end_rank
from lightning_helpers import N_IN, N_OUT, regression_data

STEPS, SAVED_AT, ACCUMULATE, BATCH = 5, 3, 2, 4


def build(fabric, seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(N_IN, 64), torch.nn.GELU(), torch.nn.Linear(64, N_OUT))
    opt = oc.wrap(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1),
                  oc.make_policy("8bit", min_int8_elements=0, whole_blocks_1d=False))
    return fabric.setup(model, opt)


def train(fabric, model, opt, steps, data) -> None:
    x_all, y_all = data.tensors
    per_step = ACCUMULATE * BATCH * fabric.world_size
    for step in steps:
        for k in range(ACCUMULATE):
            last = k == ACCUMULATE - 1
            start = step * per_step + (k * fabric.world_size + fabric.global_rank) * BATCH  # this rank's rows
            x, y = x_all[start:start + BATCH], y_all[start:start + BATCH]
            opt.set_step_boundary(last)
            with fabric.no_backward_sync(model, enabled=not last):
                fabric.backward(torch.nn.functional.mse_loss(model(x), y) / ACCUMULATE)
        opt.step()
        opt.zero_grad()


def flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def main(out_dir: str) -> None:
    torch.set_num_threads(1)
    data = regression_data(n=STEPS * ACCUMULATE * BATCH * 2)
    ckpt = str(Path(out_dir) / "fabric.ckpt")

    fabric = L.Fabric(strategy="ddp", accelerator="cpu", devices=2)
    fabric.launch()
    model, opt = build(fabric, seed=0)
    wrapper = {"class": type(opt).__name__, "is_virtual": isinstance(opt, oc.VirtualOptimizer),
               "unwrapped_is_inner": oc.unwrap(opt) is opt.optimizer}
    train(fabric, model, opt, range(SAVED_AT), data)
    fabric.save(ckpt, {"model": model, "optimizer": opt, "step": SAVED_AT})
    train(fabric, model, opt, range(SAVED_AT, STEPS), data)
    straight = flat(model)

    fabric = L.Fabric(strategy="ddp", accelerator="cpu", devices=2)  # a fresh one in the same processes
    fabric.launch()
    model, opt = build(fabric, seed=1)
    state = {"model": model, "optimizer": opt, "step": 0}
    fabric.load(ckpt, state)
    assert state["step"] == SAVED_AT and opt.step_count == SAVED_AT, (state["step"], opt.step_count)
    train(fabric, model, opt, range(SAVED_AT, STEPS), data)
    torch.save({"straight": straight, "resumed": flat(model), "step_count": opt.step_count, "wrapper": wrapper,
                "bits_per_param": opt.memory_report()["bits_per_param"]},
               Path(out_dir) / f"rank{fabric.global_rank}.pt")
    end_rank()


if __name__ == "__main__":
    main(sys.argv[1])
