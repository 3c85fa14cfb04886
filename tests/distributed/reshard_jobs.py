"""Jobs for tests/distributed/test_reshard.py: every preset trained and saved with DCP on 2 gloo
ranks (FSDP2), then loaded on 4 ranks and into one plain process; each records every parameter's
decoded state (gathered to full tensors) and its codec and tier."""
import torch
import torch.distributed as dist

import optstate_core as oc
from optstate_core.presets import PRESETS as PRESET_TABLE, has_master_weights

from dist_jobs import finish, full, init

#: every preset but the alias "default" (= "8bit"), "4bit-all" included: its 3- and 2-element
#: biases take fp32 on every mesh (a 1-D state in a block codec needs whole blocks, policy.splits_blocks)
PRESETS = [name for name in PRESET_TABLE if name != "default"]
LR = 1e-2
WIDE = 4096  # 1-D norm and bias of 4096: int8/int4 in the presets, whole 256-blocks in shards of 2 and 4 ranks
DATA = [(torch.randn(8, 16, generator=torch.Generator().manual_seed(s)),
         torch.randn(8, 2, generator=torch.Generator().manual_seed(100 + s))) for s in range(2)]


class Net(torch.nn.Module):
    """State of every kind, split differently on 2 and 4 ranks:
    fc1.weight [4096, 16] compressed, each row one partial block (2048 / 1024 rows per rank);
    fc1.bias, norm.weight, norm.bias (4096) compressed 1-D, sharded as slab columns;
    fc2.weight [3, 4096] compressed, rows 2+1 on 2 ranks, 1+1+1+0 on 4 (a rank without rows);
    fc2.bias (3), head (2 x 3 and 2) small: fp32 state, 1-D shards of 2+1 and 1+1+1+0 elements
    (under bf16w-* their master corrections are 1-D states split mid-block)."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(16, WIDE)
        self.norm = torch.nn.LayerNorm(WIDE)
        self.fc2 = torch.nn.Linear(WIDE, 3)
        self.head = torch.nn.Linear(3, 2)

    def forward(self, x):
        return self.head(torch.relu(self.fc2(self.norm(self.fc1(x)))))


def build(preset, shard):
    torch.manual_seed(0)
    model = Net()
    if has_master_weights(preset):
        oc.cast_model(model)  # bf16 weights, fp32 masters kept as optimizer state
    if shard:
        from torch.distributed.fsdp import fully_shard

        for layer in model.children():
            fully_shard(layer)
        fully_shard(model)
    return model, oc.wrap(torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1), preset)


def train(model, opt, rank, world):
    dtype = next(model.parameters()).dtype
    for x, y in DATA:
        rows = slice(rank * 8 // world, (rank + 1) * 8 // world)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x[rows].to(dtype)).float(), y[rows]).backward()
        opt.step()


def form(value):
    """What a stored state is: its codec's configuration and its tier."""
    if isinstance(value, oc.EncodedTensor):
        return value.codec.config(), "host" if value.host_tier else "device"
    return {"name": "fp32"}, "device"  # uncompressed state on the parameter's device is a raw tensor


def record(model, opt):
    """``{name: {key: full decoded tensor}}`` and ``{name: {key: (codec config, tier)}}`` (collective
    under FSDP2: every rank gathers the same tensors in the same order)."""
    decoded, forms = {}, {}
    for name, p in model.named_parameters():
        decoded[name] = {k: full(v).detach().cpu().clone() for k, v in opt.get_state(p).items()
                         if isinstance(v, torch.Tensor)}
        forms[name] = {k: form(v) for k, v in opt.state[p].items()
                       if isinstance(v, oc.EncodedTensor) or (isinstance(v, torch.Tensor) and v.dim() > 0)}
    return {"decoded": decoded, "forms": forms, "step_count": opt.step_count}


def load_into(model, opt, ckpt):
    """DCP's usual flow: the loading optimizer's own state_dict (state made by torch's zero-gradient,
    lr=0 step) as the template, load, set."""
    from torch.distributed.checkpoint import load
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)

    sd = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    load(sd, checkpoint_id=ckpt)
    set_model_state_dict(model, sd["model"])
    set_optimizer_state_dict(model, opt, sd["optim"])


def save_job(rank, world, tmp):
    """2 ranks: per preset, 2 steps, record, save ``{tmp}/ckpt/{preset}``; rank 0 writes saved.pt."""
    from torch.distributed.checkpoint import save
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    init(rank, world, f"{tmp}/save")
    out = {}
    for preset in PRESETS:
        model, opt = build(preset, shard=True)
        train(model, opt, rank, world)
        out[preset] = record(model, opt)
        save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
             checkpoint_id=f"{tmp}/ckpt/{preset}")
    if rank == 0:
        torch.save(out, f"{tmp}/saved.pt")
    finish()


def load_job(rank, world, tmp):
    """``world`` ranks: per preset, a fresh sharded model and optimizer load the checkpoint and record."""
    init(rank, world, f"{tmp}/load{world}")
    out = {}
    for preset in PRESETS:
        model, opt = build(preset, shard=True)
        load_into(model, opt, f"{tmp}/ckpt/{preset}")
        out[preset] = record(model, opt)
    if rank == 0:
        torch.save(out, f"{tmp}/loaded{world}.pt")
    finish()


def load_plain(tmp):
    """One process, no process group, plain (unsharded) parameters."""
    out = {}
    for preset in PRESETS:
        model, opt = build(preset, shard=False)
        load_into(model, opt, f"{tmp}/ckpt/{preset}")
        out[preset] = record(model, opt)
    return out
