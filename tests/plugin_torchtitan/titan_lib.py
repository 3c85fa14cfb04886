"""Shared pieces of the torchtitan plugin tests (also imported by the spawned gloo ranks).

A tiny model trained the way torchtitan's ``Trainer.train_step`` does it: ``zero_grad``, one
forward/backward, torchtitan's ``dist_utils.clip_grad_norm_`` over every parameter, the
container's ``step()``, the LR schedulers' ``step()``; checkpoints through torchtitan's own
``CheckpointManager`` (its flat optimizer keys, DCP underneath)."""
import os
import sys

import torch
import torch.distributed as dist

from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
from torchtitan.distributed import utils as dist_utils

import optstate_core as oc
from optstate_torchtitan import OptstateOptimizersContainer, optstate_optimizers

LR = 1e-2
MAX_NORM = 0.1  # below the gradients' norms on this task (0.15-0.22), so clipping acts on every step
DATA = [(torch.randn(8, 256, generator=g), torch.randn(8, 256, generator=g))
        for g in [torch.Generator().manual_seed(11)] for _ in range(6)]


def build_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256),
                               torch.nn.GELU(), torch.nn.Linear(256, 256))


def shard(model):
    """FSDP2 over each Linear, then the root (torchtitan's per-block sharding in small)."""
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model


def container_config(preset="8bit", release=False, implementation="fused", **keys):
    cfg = optstate_optimizers(default_adamw(lr=LR), preset=preset, release_gradients=release,
                              max_grad_norm=MAX_NORM, **keys)
    cfg.implementation = implementation
    return cfg


def build(model, preset="8bit", release=False, **keys):
    """(container, LR schedulers) as the trainer builds them."""
    optimizers = container_config(preset, release, **keys).build(model_parts=[model])
    assert isinstance(optimizers, OptstateOptimizersContainer)
    schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optimizers, training_steps=10)
    return optimizers, schedulers


def train(model, optimizers, schedulers, steps, first=0, rank=0, world=1):
    """torchtitan's train step, ``steps`` times from batch ``first``; returns the clip norms it saw."""
    norms = []
    for s in range(first, first + steps):
        x, y = DATA[s]
        rows = slice(rank * 8 // world, (rank + 1) * 8 // world)
        optimizers.zero_grad()
        torch.nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
        norms.append(float(dist_utils.clip_grad_norm_(list(model.parameters()), MAX_NORM, foreach=True)))
        optimizers.step()
        schedulers.step()
    return norms


def checkpointer(model, optimizers, schedulers, folder):
    """torchtitan's DCP checkpoint manager over the model, the container and the schedulers."""
    cfg = CheckpointManager.Config(enable=True, folder="checkpoint", interval=1, keep_latest_k=0)
    return cfg.build(dataloader=None, model_parts=[model], optimizers=optimizers, lr_schedulers=schedulers,
                     states={}, sd_adapter=None, base_folder=folder)


def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def params(model):
    return [full(p.detach()).clone() for p in model.parameters()]


def decoded_state(optimizers):
    """Every optimizer's state, decoded to fp32, whole (gathered) tensors, by parameter order."""
    out = []
    for opt in optimizers.optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                out.append({k: full(v).clone() if isinstance(v, torch.Tensor) else v
                            for k, v in sorted(opt.get_state(p).items())})
    return out


def same(a, b):
    """Bit for bit: tensors (nested in lists/dicts) equal in dtype, shape and every value."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


# -- two gloo ranks (torch.multiprocessing.spawn) ----------------------------------------------------
def fsdp_job(rank, world, tmp):
    """On each rank, for release off and on: FSDP2 model + plugin container, 2 steps, torchtitan's
    checkpoint save, 1 more step (the expected result); a fresh model and container load the
    checkpoint and take the same step. Rank 0 writes what the parent compares."""
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"file://{tmp}/pg")
    out = {}
    for release in (False, True):
        folder = f"{tmp}/release{int(release)}"
        model = shard(build_model())
        optimizers, schedulers = build(model, release=release)
        train(model, optimizers, schedulers, 2, rank=rank, world=world)
        state_at_save = decoded_state(optimizers)
        ckpt = checkpointer(model, optimizers, schedulers, folder)
        ckpt.save(curr_step=2)
        ckpt.close()
        flat = optimizers.state_dict()
        w = "state.0.weight.exp_avg.encoded.payload.codes"
        local_rows = flat[w].to_local().shape[0] if hasattr(flat[w], "to_local") else None
        train(model, optimizers, schedulers, 1, first=2, rank=rank, world=world)
        expected = params(model)

        model2 = shard(build_model(seed=1))  # other weights: the checkpoint must restore them
        optimizers2, schedulers2 = build(model2, release=release)
        ckpt2 = checkpointer(model2, optimizers2, schedulers2, folder)
        assert ckpt2.load(step=2)
        ckpt2.close()
        loaded_state = decoded_state(optimizers2)
        step_count = optimizers2.optimizers[0].step_count
        train(model2, optimizers2, schedulers2, 1, first=2, rank=rank, world=world)
        out[release] = {"expected": expected, "resumed": params(model2), "state_at_save": state_at_save,
                        "loaded_state": loaded_state, "step_count": step_count, "local_rows": local_rows,
                        "dtensor_payload": type(flat[w]).__name__,
                        "global_rows": flat[w].shape[0]}
    if rank == 0:
        torch.save(out, f"{tmp}/result.pt")
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # gloo's threads outlive destroy_process_group (tests/distributed/dist_jobs.py: finish)
