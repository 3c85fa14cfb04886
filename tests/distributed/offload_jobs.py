"""A 2-rank gloo job for tests/distributed/test_fsdp_offload.py: FSDP2 with offloaded state on the
fused path (Triton interpreter on the CPU), against the same FSDP2 run with resident state."""
import os

import torch

import dist_jobs
import optstate_core as oc


def run(model, offload, rank, world):
    """4 steps of 2 micro-batches each (boundary marked); per step the bytes staged in backward."""
    opt = oc.wrap(torch.optim.AdamW(model.parameters(), lr=dist_jobs.LR),
                  oc.make_policy("8bit", min_int8_elements=300), fused=True, offload=offload, staging_bytes="64KB")
    staged = []
    for s in range(4):
        for micro in range(2):
            opt.set_step_boundary(micro == 1)
            x, y = dist_jobs.DATA[2 * s + micro]
            rows = slice(rank * 8 // world, (rank + 1) * 8 // world)
            torch.nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
        opt.step()
        opt.zero_grad()
        staged.append(opt.memory_report()["prefetch"]["bytes_by_phase"]["backward"])
    params = [dist_jobs.full(p.detach()).clone() for p in model.parameters()]
    states = [dist_jobs.full(opt.get_state(p)[k]).clone() for p in model.parameters() for k in ("exp_avg", "exp_avg_sq")]
    return params, states, staged


def fsdp_offload_job(rank, world, tmp):
    dist_jobs.init(rank, world, tmp)
    resident = run(dist_jobs.shard_layers(dist_jobs.build_model()), False, rank, world)
    offloaded = run(dist_jobs.shard_layers(dist_jobs.build_model()), True, rank, world)
    out = {"params_equal": all(torch.equal(a, b) for a, b in zip(resident[0], offloaded[0])),
           "states_equal": all(torch.equal(a, b) for a, b in zip(resident[1], offloaded[1])),
           "staged": offloaded[2], "interpreted": os.environ.get("TRITON_INTERPRET") == "1"}
    if rank == 0:
        torch.save(out, f"{tmp}/offload_result.pt")
    dist_jobs.finish()
