"""Jobs run by 2 gloo processes for tests/distributed (imported by the spawned workers)."""
import os
import sys

import torch
import torch.distributed as dist

import optstate_core as oc

LR = 1e-2
BATCH = torch.Generator().manual_seed(7)
DATA = [(torch.randn(8, 256, generator=BATCH), torch.randn(8, 256, generator=BATCH)) for _ in range(8)]


def build_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256),
                               torch.nn.GELU(), torch.nn.Linear(256, 256))


def make_optimizer(model):
    # The 512-element bias is sharded in aligned halves (int8 on each rank). 256-element biases
    # would split into 128-element shards, which cannot hold whole blocks (fp32 under FSDP2):
    # min_int8_elements=300 keeps them fp32 in the single-process reference too.
    fused = True if os.environ.get("OPTSTATE_TEST_FUSED") == "1" else None  # fused kernels (interpreted)
    return oc.wrap(torch.optim.AdamW(model.parameters(), lr=LR),
                   oc.make_policy("8bit", min_int8_elements=300), fused=fused)


def train(model, opt, steps, rank=0, world=1, first=0):
    for s in range(first, first + steps):
        x, y = DATA[s]
        rows = slice(rank * 8 // world, (rank + 1) * 8 // world)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
        opt.step()


def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def init(rank, world, tmp):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"file://{tmp}/pg")


def finish():
    """End a spawned rank: barrier, destroy the process group, exit without interpreter teardown.

    After DDP or FSDP2 has used it, the gloo process group outlives ``destroy_process_group``:
    its three threads (``gloo_tcp_loop`` and two ``pt_gloo_runloop``) are still running when the
    job returns, with the model and optimizer freed (a bare all_reduce/broadcast does not leak
    them). A process that exits normally with them running destroys C++ statics under live
    threads: the way a rank can abort at exit with "terminate called without an active
    exception" (2 of 10 runs in issue 17; not reproduced here). ``os._exit`` ends the rank
    without that teardown; the results are already on disk and the parent checks exit codes.
    """
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def shard_layers(model):
    """FSDP2 over each Linear, then the whole model."""
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model


def dcp_round_trip(model, opt, sharded, train_more, ckpt, out):
    """Save model+optimizer with DCP, train on (``out["expected"]``), load into fresh ``sharded()``
    objects (``out["resumed_step_count"]``) and train the same steps (``out["resumed"]``)."""
    from torch.distributed.checkpoint import load, save
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)

    save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=ckpt)
    train_more(model, opt)
    out["expected"] = [full(p.detach()).float().clone() for p in model.parameters()]
    model2, opt2 = sharded()
    sd = {"model": get_model_state_dict(model2), "optim": get_optimizer_state_dict(model2, opt2)}
    load(sd, checkpoint_id=ckpt)
    set_model_state_dict(model2, sd["model"])
    set_optimizer_state_dict(model2, opt2, sd["optim"])
    out["resumed_step_count"] = opt2.step_count
    train_more(model2, opt2)
    out["resumed"] = [full(p.detach()).float().clone() for p in model2.parameters()]


def fsdp_job(rank, world, tmp):
    init(rank, world, tmp)

    def sharded():
        model = shard_layers(build_model())
        return model, make_optimizer(model)

    model, opt = sharded()
    train(model, opt, 3, rank, world)
    out = {"params": [full(p.detach()).clone() for p in model.parameters()],
           "local_state_bytes": opt.memory_report()["state_bytes"],
           "codecs": [opt.state[p]["exp_avg"].codec.name if isinstance(opt.state[p]["exp_avg"], oc.EncodedTensor)
                      else "fp32" for p in model.parameters()],
           "exp_avg": [full(opt.get_state(p)["exp_avg"]).clone() for p in model.parameters()]}

    # a NaN in one rank's shard skips that parameter on every rank
    opt.zero_grad()
    x, y = DATA[3]
    torch.nn.functional.mse_loss(model(x[rank * 4:(rank + 1) * 4]), y[rank * 4:(rank + 1) * 4]).backward()
    w = model[2].weight
    if rank == 1:
        w.grad._local_tensor[0, 0] = float("nan")
    before = full(w.detach()).clone()
    opt.step()
    out["nan_param_unchanged"] = torch.equal(full(w.detach()), before)
    out["nonfinite_skipped"] = opt.memory_report()["nonfinite_skipped"]

    # DCP round trip: save, continue 2 steps; reload into fresh objects and redo the 2 steps
    dcp_round_trip(model, opt, sharded, lambda m, o: train(m, o, 2, rank, world, first=4), f"{tmp}/dcp", out)
    if rank == 0:
        torch.save(out, f"{tmp}/fsdp_result.pt")
    finish()


def fsdp_fp32_fused_job(rank, world, tmp):
    """FSDP2 with fp32 state of a ``fused=True`` AdamW: the kernels step the local shards with
    torch's fused arithmetic (interpreted here); the same setup with torch's AdamW alone beside it."""
    init(rank, world, tmp)
    out = {}
    for name, wrap in (("optstate", True), ("torch", False)):
        model = shard_layers(build_model())
        inner = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1, fused=True)
        opt = oc.wrap(inner, "fp32", fused=True) if wrap else inner
        train(model, opt, 3, rank, world)
        out[name] = [full(p.detach()).clone() for p in model.parameters()]
        if wrap:
            out["fused_params"] = opt.last_step_timings["fused_params"]
    if rank == 0:
        torch.save(out, f"{tmp}/fsdp_fp32_result.pt")
    finish()


def ddp_job(rank, world, tmp):
    init(rank, world, tmp)
    model = torch.nn.parallel.DistributedDataParallel(build_model())
    opt = make_optimizer(model)
    train(model, opt, 3, rank, world)
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(params) for _ in range(world)]
    dist.all_gather(gathered, params)
    if rank == 0:
        torch.save({"params": params, "ranks_equal": all(torch.equal(g, params) for g in gathered)},
                   f"{tmp}/ddp_result.pt")
    finish()


def master_model():
    """build_model() in bf16 with its fp32 masters remembered (``cast_model``)."""
    model = build_model()
    oc.cast_model(model)
    return model


def master_optimizer(model):
    return oc.wrap(torch.optim.AdamW(model.parameters(), lr=LR), oc.make_policy("bf16w-8bit", min_int8_elements=300))


def train_bf16(model, opt, steps, rank=0, world=1, first=0):
    for s in range(first, first + steps):
        x, y = DATA[s]
        rows = slice(rank * 8 // world, (rank + 1) * 8 // world)
        opt.zero_grad()
        out = model(x[rows].to(torch.bfloat16)).float()
        torch.nn.functional.mse_loss(out, y[rows]).backward()
        opt.step()


def bf16_dcp_job(rank, world, tmp, sharded, observe, name):
    """Train ``sharded()``'s bf16 model 3 steps, note ``observe(model, opt)``, then a DCP round trip of
    2 more steps; rank 0 writes ``{name}_result.pt``."""
    init(rank, world, tmp)
    model, opt = sharded()
    train_bf16(model, opt, 3, rank, world)
    out = observe(model, opt)
    dcp_round_trip(model, opt, sharded, lambda m, o: train_bf16(m, o, 2, rank, world, first=3), f"{tmp}/dcp_{name}",
                   out)
    if rank == 0:
        torch.save(out, f"{tmp}/{name}_result.pt")
    finish()


def fsdp_master_job(rank, world, tmp):
    """FSDP2 over bf16 parameters whose masters are optimizer state (sharded like the moments)."""
    from optstate_core.state.master_weights import MASTER_KEY

    def sharded():
        model = shard_layers(master_model())
        return model, master_optimizer(model)

    def observe(model, opt):
        return {"params": [full(p.detach()).float().clone() for p in model.parameters()],
                "masters": [full(m).clone() for m in oc.master_state_dict(model, opt).values()],
                "has_correction": [MASTER_KEY in opt.state[p] for p in model.parameters()],
                "local_state_bytes": opt.memory_report()["state_bytes"]}

    bf16_dcp_job(rank, world, tmp, sharded, observe, "fsdp_master")


def fsdp_host_state_job(rank, world, tmp):
    """FSDP2 with every state in host memory (``bf16w-4bit-lean-offload``, gradient release), then
    a DCP round trip. The 256-element biases split into 128-element shards, which cannot hold
    whole blocks: their state stays uncompressed, as host-tier encoded values."""
    def sharded():
        model = shard_layers(master_model())
        opt = oc.wrap(torch.optim.AdamW(model.parameters(), lr=LR),
                      oc.make_policy("bf16w-4bit-lean-offload", min_int8_elements=300),
                      release_gradients=True, max_grad_norm=1.0)
        return model, opt

    def observe(model, opt):
        bias = model[2].bias  # 256 elements: a 128-element shard per rank
        return {"bias_state_on_host": all(getattr(v, "host_tier", False) for k, v in opt.state[bias].items()
                                          if k != "step")}

    bf16_dcp_job(rank, world, tmp, sharded, observe, "fsdp_host_state")


def sharded_build_job(rank, world, tmp):
    """A named Llama shape built on the meta device and sharded there (FSDP2, each layer and the
    root), then materialized: each rank holds and initializes only its shards; a step with a
    wrapped optimizer runs. Rank 0 writes what it saw."""
    init(rank, world, tmp)
    from optstate_core.apps.llama import NAMED_SHAPES, build_model as build_named, shard_each_layer

    shape = NAMED_SHAPES["tiny"]
    model = build_named(shape, torch.device("cpu"), torch.float32, shard=shard_each_layer)
    params = list(model.parameters())
    local = [p._local_tensor for p in params]
    seen = {"global": sum(p.numel() for p in params), "local": sum(t.numel() for t in local),
            "on_cpu": all(t.device.type == "cpu" for t in local),
            "norms_one": all(bool((t == 1).all()) for p, t in zip(params, local) if p.dim() == 1),
            "matrix_std": float(torch.cat([t.reshape(-1) for p, t in zip(params, local) if p.dim() == 2]).std())}
    opt = oc.wrap(torch.optim.AdamW(params, lr=1e-3), "8bit")
    tokens = torch.randint(0, shape.vocab, (2, 16), generator=torch.Generator().manual_seed(rank))
    losses = []
    for _ in range(3):
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    seen["losses"] = losses
    if rank == 0:
        torch.save(seen, os.path.join(tmp, "sharded_build.pt"))
    finish()
