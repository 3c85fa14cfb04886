"""2-rank gloo jobs for tests/distributed/test_fsdp_schedule.py, on the fused path (Triton
interpreter on the CPU): FSDP2 with offloaded state against resident state, and FSDP2 with
gradient release (resident or offloaded state) against FSDP2 without it."""
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


def release_model():
    """An MLP with biases and a LayerNorm, FSDP2-sharded: the small tensors keep fp32 state and take
    the same path (the kernels, beside the compressed ones) with and without release."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.LayerNorm(512),
                                torch.nn.Linear(512, 256), torch.nn.GELU(), torch.nn.Linear(256, 256))
    return dist_jobs.shard_layers(model)


def release_run(model, release, rank, world, nan_step=None, offload=False):
    """3 windows of 2 micro-batches (boundary marked); the global norm each step (``last_grad_norm``
    with release, torch's DTensor-aware ``clip_grad_norm_`` without), the skip count. ``offload``:
    every shard's state in host memory, streamed through the staging ring in the hooks."""
    opt = oc.wrap(torch.optim.AdamW(model.parameters(), lr=dist_jobs.LR), "8bit", fused=True,
                  release_gradients=release, max_grad_norm=1e9 if release else None, offload=offload,
                  staging_bytes="64KB")
    norms, unchanged = [], None
    for s in range(3):
        before = [dist_jobs.full(p.detach()).clone() for p in model.parameters()]
        for micro in range(2):
            opt.set_step_boundary(micro == 1)
            x, y = dist_jobs.DATA[2 * s + micro]
            rows = slice(rank * 8 // world, (rank + 1) * 8 // world)
            if s == nan_step and micro == 1 and rank == 1:
                x = x.clone()
                x[rows.start] = float("nan")
            torch.nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
        if not release:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))))
        opt.step()
        if release:
            norms.append(float(opt.last_grad_norm) if s != nan_step else float("nan"))
        opt.zero_grad()
        if s == nan_step:
            unchanged = all(torch.equal(a, dist_jobs.full(p.detach())) for a, p in zip(before, model.parameters()))
    params = [dist_jobs.full(p.detach()).clone() for p in model.parameters()]
    return params, norms, opt.memory_report()["nonfinite_skipped"], unchanged


def fsdp_release_job(rank, world, tmp):
    dist_jobs.init(rank, world, tmp)
    plain = release_run(release_model(), False, rank, world)
    released = release_run(release_model(), True, rank, world)
    nan = release_run(release_model(), True, rank, world, nan_step=1)
    streamed = release_run(release_model(), True, rank, world, offload=True)
    # plain data parallelism: refused at the first backward (at wrap() the parameters may still be
    # sharded later: Accelerate's and the Trainer's FSDP2 prepare come after the optimizer), nothing updated
    ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
    ddp_opt = oc.wrap(torch.optim.AdamW(ddp.parameters()), "8bit", release_gradients=True)
    before = [p.detach().clone() for p in ddp.parameters()]
    try:
        ddp_error = None
        ddp(torch.ones(2, 4)).sum().backward()
    except ValueError as e:
        ddp_error = str(e)
    ddp_error = ddp_error if all(torch.equal(a, p) for a, p in zip(before, ddp.parameters())) and \
        not ddp_opt.state else "parameters or state changed"
    out = {"params_equal": all(torch.equal(a, b) for a, b in zip(plain[0], released[0])),
           "offload_equal": all(torch.equal(a, b) for a, b in zip(plain[0], streamed[0])),
           "norms": (plain[1], released[1]), "nan_unchanged": nan[3], "nan_skipped": nan[2], "ddp_error": ddp_error}
    if rank == 0:
        torch.save(out, f"{tmp}/release_result.pt")
    dist_jobs.finish()
