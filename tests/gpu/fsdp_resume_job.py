"""2-rank NCCL job for tests/gpu/test_fsdp_resume.py: FSDP2 (fully_shard per block) + DCP save,
continue, and a resume into a fresh model and optimizer, per preset on the fused path."""
import os
import sys

import torch
import torch.distributed as dist

import optstate_core as oc

BLOCKS, WIDTH, HIDDEN = 4, 1024, 4096


def build(preset, options, rank):
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    blocks = [torch.nn.Sequential(torch.nn.Linear(WIDTH, HIDDEN), torch.nn.GELU(), torch.nn.Linear(HIDDEN, WIDTH))
              for _ in range(BLOCKS)]
    model = torch.nn.Sequential(*blocks).cuda()
    if oc.presets.has_master_weights(preset):
        oc.cast_model(model)
    for block in model:
        fully_shard(block)
    fully_shard(model)
    opt = oc.wrap(torch.optim.AdamW(model.parameters(), lr=1e-3), preset, **options)
    return model, opt


def train(model, opt, first, steps, rank, world):
    losses = []
    dtype = next(model.parameters()).dtype
    for s in range(first, first + steps):
        gen = torch.Generator(device="cuda").manual_seed(s)
        x = torch.randn(8 * world, WIDTH, device="cuda", generator=gen)[8 * rank:8 * (rank + 1)]
        opt.zero_grad()
        loss = (model(x.to(dtype)).float() - x).pow(2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return torch.stack(losses)


def full_state(model, opt):
    """The optimizer's state as DCP sees it, every DTensor gathered (for comparisons)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    out = {}
    for fqn, entry in get_optimizer_state_dict(model, opt)["state"].items():
        for key, value in entry.items():
            flat = value if isinstance(value, dict) else {"": value}
            for name, t in flat.items():
                if isinstance(t, torch.Tensor):
                    out[f"{fqn}.{key}.{name}"] = (t.full_tensor() if hasattr(t, "full_tensor") else t).clone()
    return out


def case(preset, options, rank, world, tmp):
    from torch.distributed.checkpoint import load, save
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)
    tag = preset + ("-release" if options.get("release_gradients") else "")
    model, opt = build(preset, options, rank)
    train(model, opt, 0, 10, rank, world)
    saved_state = full_state(model, opt)
    save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
         checkpoint_id=f"{tmp}/{tag}")
    expected = train(model, opt, 10, 10, rank, world)
    model2, opt2 = build(preset, options, rank)
    train(model2, opt2, 100, 3, rank, world)
    sd = {"model": get_model_state_dict(model2), "optim": get_optimizer_state_dict(model2, opt2)}
    load(sd, checkpoint_id=f"{tmp}/{tag}")
    set_model_state_dict(model2, sd["model"])
    set_optimizer_state_dict(model2, opt2, sd["optim"])
    loaded_state = full_state(model2, opt2)
    differing_state = sorted(k for k in saved_state if not torch.equal(saved_state[k], loaded_state.get(k, torch.empty(0))))
    first = train(model2, opt2, 10, 1, rank, world)
    fused_first = opt2.last_step_timings["materialize_ms"] == 0
    resumed = torch.cat([first, train(model2, opt2, 11, 9, rank, world)])
    diff = (resumed - expected).abs() / expected.abs()
    return {"equal": bool(torch.equal(resumed, expected)), "max_rel": float(diff.max()),
            "first_diff": int((diff > 0).nonzero()[0]) if bool((diff > 0).any()) else None,
            "differing_state": differing_state[:8], "fused_first": fused_first,
            "step_count": (opt.step_count, opt2.step_count)}


CASES = [("8bit", {}), ("4bit", {}), ("bf16w-4bit-lean", {"release_gradients": True}), ("4bit", {"release_gradients": True}),
         ("bf16w-4bit-lean-offload", {"release_gradients": True})]  # the capped mode: every shard's state on the host


def job(rank, world, tmp):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, init_method=f"file://{tmp}/pg",
                            device_id=torch.device("cuda", rank))
    out = {}
    for preset, options in CASES:
        tag = preset + ("+release" if options.get("release_gradients") else "")
        out[tag] = case(preset, options, rank, world, tmp)
    if rank == 0:
        torch.save(out, f"{tmp}/fsdp_resume.pt")
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)
