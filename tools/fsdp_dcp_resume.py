"""FSDP2 + DCP resume of a named Llama shape on every GPU of a node: save, continue, and resume into a
fresh model and optimizer that had trained other steps; the resumed run must continue bit for bit.

    torchrun --nproc_per_node 4 tools/fsdp_dcp_resume.py --model 8b --checkpoint /tmp/dcp \
        --optimizers bf16w-4bit-lean+release,bf16w-4bit-lean-offload+release

The model is built on the meta device and sharded there (each rank materializes its shards), bf16
weights for ``bf16w-*`` contenders, activation checkpointing, the chunked loss; every rank trains
on its own random tokens per step. Rank 0 prints one ``ROW {json}`` per contender: the losses of
the uninterrupted and the resumed run, whether they are equal, how many local parameter shards and
optimizer-state tensors differ at the end, the checkpoint's size on disk and the save/load seconds.

``--repeats N`` runs that round trip N times per contender in one process and prints a ``SUMMARY``
of how many differed (the 8B offloaded run with release differs in some runs only: BENCHMARKS.md
section 35); ``--wrap-option KEY=VALUE`` passes further ``wrap()`` options (``prefetch_budget=0``,
``release_bucket_bytes=...``) to bisect which part of the step it comes from; ``--trace`` checks the
load itself.
"""
import argparse
import ast
import json
import os
import shutil
import time

# pinned host memory registered by 8 threads: offloaded state is pinned in the first iteration, ~5x faster
# this way than with cudaHostAlloc (tools/pin_bench.py; unless the caller set the variable)
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "pinned_use_cuda_host_register:True,pinned_num_register_threads:8")

import torch  # noqa: E402
import torch.distributed as dist


def train(model, opt, first, steps, batch, seq, vocab):
    """``steps`` steps on tokens drawn from (step, rank); the losses."""
    losses = []
    for s in range(first, first + steps):
        gen = torch.Generator(device="cuda").manual_seed(s * 1000 + dist.get_rank())
        tokens = torch.randint(0, vocab, (batch, seq), device="cuda", generator=gen)
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return torch.stack(losses).tolist()


def fingerprints(model, opt):
    """A position-weighted checksum of each local tensor's bytes (``--trace``: cheaper than clones)."""
    out = {}
    for name, t in local_tensors(model, opt, clone=False).items():
        raw = t.detach().reshape(-1).view(torch.uint8)
        total = 0
        for start in range(0, raw.numel(), 1 << 26):
            chunk = raw[start:start + (1 << 26)].to("cuda", non_blocking=False).to(torch.int64)
            weights = torch.arange(start, start + chunk.numel(), device="cuda", dtype=torch.int64) % 65521 + 1
            total += int((chunk * weights).sum())
        out[name] = total
    return out


def diverged(a, b):
    """Names whose fingerprints differ (or exist in one only)."""
    return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))


def local_tensors(model, opt, clone=True):
    """Every local parameter shard and optimizer-state tensor as DCP sees them, by name (cloned)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    copy = (lambda t: t.clone()) if clone else (lambda t: t)
    out = {f"param.{n}": copy((p._local_tensor if hasattr(p, "_local_tensor") else p).detach())
           for n, p in model.named_parameters()}
    for fqn, entry in get_optimizer_state_dict(model, opt)["state"].items():
        for key, value in entry.items():
            for name, t in (value.items() if isinstance(value, dict) else [("", value)]):
                if isinstance(t, torch.Tensor):
                    out[f"state.{fqn}.{key}.{name}"] = copy(t._local_tensor if hasattr(t, "_local_tensor") else t)
    return out


def round_trip(args, c, name, fresh, shape, repeat):
    """Train, save, continue; a fresh model and optimizer load the checkpoint and continue the same;
    rank 0 prints the ROW. Returns the differing tensors plus ranks with other losses (0: bit for bit)."""
    from torch.distributed.checkpoint import load, save
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)
    rank, world = dist.get_rank(), dist.get_world_size()
    path = os.path.join(args.checkpoint, name.replace("+", "_"))
    run = (args.batch, args.seq, shape.vocab)
    model, opt = fresh(c, seed=0)
    before = train(model, opt, 0, args.steps, *run)
    saved = fingerprints(model, opt) if args.trace else None
    dist.barrier()
    t0 = time.perf_counter()
    save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=path)
    dist.barrier()
    save_s = time.perf_counter() - t0
    expected = train(model, opt, args.steps, args.steps, *run)
    final = local_tensors(model, opt)
    if hasattr(opt, "close"):
        opt.close()
    del model, opt
    torch.cuda.empty_cache()
    model, opt = fresh(c, seed=1)
    train(model, opt, 10_000, 1, *run)  # other data: the load must overwrite everything
    t0 = time.perf_counter()
    sd = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    load(sd, checkpoint_id=path)
    set_model_state_dict(model, sd["model"])
    set_optimizer_state_dict(model, opt, sd["optim"])
    del sd
    dist.barrier()
    load_s = time.perf_counter() - t0
    if args.trace:  # per rank: what the load did not restore
        lost = diverged(saved, fingerprints(model, opt))
        print("TRACE " + json.dumps({"rank": rank, "optimizer": name, "not_restored": len(lost),
                                     "of": len(saved), "first": lost[:8]}), flush=True)
    resumed = train(model, opt, args.steps, args.steps, *run)
    ended = local_tensors(model, opt)
    differing = sorted(k for k in final if not torch.equal(final[k], ended.get(k, torch.empty(0))))
    missing = len(set(final) ^ set(ended))
    counts = torch.tensor([len(differing), missing, int(resumed != expected)], device="cuda")
    dist.all_reduce(counts)
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs) if rank == 0 else 0
    if rank == 0:
        print("ROW " + json.dumps({
            "optimizer": name, "repeat": repeat, "model": args.model, "world": world,
            "device": torch.cuda.get_device_name(),
            "batch": args.batch, "seq": args.seq, "losses_before": before, "expected": expected,
            "resumed": resumed, "equal_losses_all_ranks": int(counts[2]) == 0,
            "differing_tensors_all_ranks": int(counts[0]), "unmatched_names_all_ranks": int(counts[1]),
            "first_differing_rank0": differing[:5], "tensors_compared_rank0": len(final),
            "checkpoint_gb": size / 1e9, "save_s": save_s, "load_s": load_s, "torch": torch.__version__}),
            flush=True)
        shutil.rmtree(path, ignore_errors=True)
    if hasattr(opt, "close"):
        opt.close()
    del model, opt, final, ended
    torch.cuda.empty_cache()
    dist.barrier()
    return int(counts[0]) + int(counts[2])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="8b")
    parser.add_argument("--optimizers", default="bf16w-4bit-lean+release")
    parser.add_argument("--checkpoint", required=True, help="a folder for the DCP checkpoints (removed after each)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--steps", type=int, default=3, help="steps before the save, and after it")
    parser.add_argument("--trace", action="store_true",
                        help="checksum every tensor at the save and after the load (no sync added inside the "
                             "steps); print per rank which tensors the load did not restore")
    parser.add_argument("--repeats", type=int, default=1,
                        help="round trips per optimizer in this process (a SUMMARY line counts those that differed)")
    parser.add_argument("--wrap-option", action="append", default=[], metavar="KEY=VALUE",
                        help="a further wrap() option for optstate contenders, e.g. prefetch_budget=0 (repeatable; "
                             "VALUE a Python literal)")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    options = {}
    for item in args.wrap_option:
        key, sep, value = item.partition("=")
        if not sep or not key.isidentifier():
            parser.error(f"--wrap-option takes KEY=VALUE, got {item!r}")
        try:
            options[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            parser.error(f"--wrap-option {key}: VALUE must be a Python literal, got {value!r}")
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    from optstate_core.apps import contenders
    from optstate_core.apps.llama import NAMED_SHAPES, build_model, shard_each_layer
    from optstate_core.apps.chunked_loss import use_chunked_loss

    shape = NAMED_SHAPES[args.model]

    def fresh(c, seed):
        model = use_chunked_loss(build_model(shape, "cuda", c.weights, checkpointing=True, seed=seed,
                                             shard=shard_each_layer))
        return model, contenders.build(c, list(model.parameters()), model,
                                       max_grad_norm=1.0 if c.release else None, **options)

    for name in args.optimizers.split(","):
        c = contenders.parse(name)
        differed = [round_trip(args, c, name, fresh, shape, r) > 0 for r in range(args.repeats)]
        if rank == 0:
            print("SUMMARY " + json.dumps({"optimizer": name, "model": args.model, "repeats": args.repeats,
                                           "runs_that_differed": sum(differed), "options": options}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
