"""Worker of test_accelerate_ddp.py, started by ``accelerate launch`` on 2 CPU processes (gloo).

Trains the test MLP with wrap(AdamW) (int8 after an adaptive warmup fed through
optstate_accelerate.observe_loss) under ``accelerator.accumulate``, then checks on every rank
against a single-process reference that sees all ranks' data; rank 0 writes a JSON summary.
"""
import json
import os
import sys

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [ROOT, os.path.join(ROOT, "integrations"), os.path.dirname(HERE)]

from accelerate import Accelerator  # noqa: E402

import optstate_accelerate as osa  # noqa: E402
import optstate_core as oc  # noqa: E402
from helpers import batch, flat_params, mlp, same_up_to_rounding_flips  # noqa: E402
from job_exit import end_rank  # noqa: E402

ACCUM, WINDOWS, LR = 2, 6, 1e-2


def make_optimizer(model):
    policy = oc.AdaptiveWarmupPolicy(warmup_steps=1000, patience=2, tol=0.5, min_int8_elements=256,
                                     variance_codec="int8")
    return oc.wrap(torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01), policy)


def data(rank, i):
    return batch(1000 + 100 * rank + i, n=16)


def main(out_path):
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ACCUM)
    rank, world = accelerator.process_index, accelerator.num_processes
    assert world == 2 and torch.distributed.get_backend() == "gloo"
    model = mlp(0)
    vopt = make_optimizer(model)
    model, optimizer = accelerator.prepare(model, vopt)
    osa.attach(accelerator, optimizer)
    switched_at = None
    for i in range(ACCUM * WINDOWS):
        x, y = data(rank, i)
        with accelerator.accumulate(model):
            loss = F.cross_entropy(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            osa.observe_loss(accelerator, optimizer, loss)
            if switched_at is None and vopt.policy.switched:
                switched_at = vopt.step_count
    params = flat_params(accelerator.unwrap_model(model))
    everyone = accelerator.gather(params.unsqueeze(0))
    summary = accelerator.gather(torch.tensor([[vopt.step_count, -1 if switched_at is None else switched_at,
                                                vopt.memory_report()["bits_per_param"]]], dtype=torch.float64))

    # the same job in one process: each window's gradient is the mean over ranks and micro-batches
    ref_model = mlp(0)
    ref = make_optimizer(ref_model)
    for w in range(WINDOWS):
        last = []
        for r in range(world):
            for k in range(ACCUM):
                x, y = data(r, w * ACCUM + k)
                loss = F.cross_entropy(ref_model(x), y)
                (loss / (ACCUM * world)).backward()
                if k == ACCUM - 1:
                    last.append(loss.item())
        ref.step()
        ref.zero_grad()
        ref.observe_loss(sum(last) / world)
    diff = (flat_params(ref_model) - params).abs()
    result = {
        "ranks_identical": bool(torch.equal(everyone[0], everyone[1])),
        "step_counts": summary[:, 0].tolist(),
        "switched_at": summary[:, 1].tolist(),
        "bits_per_param": summary[:, 2].tolist(),
        "max_diff_from_reference": float(diff.max()),
        "over_1e-5": int((diff > 1e-5).sum()),
        "same_up_to_rounding_flips": same_up_to_rounding_flips(diff),
        "moved": float((params - flat_params(mlp(0))).abs().max()),
        "reference_step_count": ref.step_count,
        "reference_switched": ref.policy.switched,
    }
    if accelerator.is_main_process:
        with open(out_path, "w") as f:
            json.dump(result, f)
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main(sys.argv[1])
    end_rank()  # job_exit.py: no interpreter teardown after gloo
