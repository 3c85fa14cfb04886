"""FSDP2 benchmark on several GPUs: per-rank optimizer memory and step time, optstate vs
torch.optim.AdamW(fused=True) under the same FSDP2 setup.

    torchrun --nproc_per_node 2 tools/fsdp_bench.py [--layers 16] [--steps 8]

A Llama-shaped model from a config (hidden 2048, vocab 32000), each decoder layer and the root
wrapped with ``fully_shard``, fp32 master weights, bf16 autocast, random tokens.
"""
import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

import optstate_core as oc
from optstate_core.apps.measure import state_bytes
from optstate_core.apps.e2e import build_model


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    args = parser.parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    device = torch.device("cuda")
    from torch.distributed.fsdp import fully_shard

    configs = {
        "torch AdamW fused": lambda ps: torch.optim.AdamW(ps, fused=True),
        "optstate int8 resident": lambda ps: oc.wrap(torch.optim.AdamW(ps, fused=True), "8bit"),
        "optstate int8 offloaded": lambda ps: oc.wrap(torch.optim.AdamW(ps, fused=True), "8bit", offload=True),
    }
    rows = []
    for label, build in configs.items():
        torch.manual_seed(0)
        model = build_model(2048, args.layers, 32000, 5632, device)
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        params = list(model.parameters())
        n_local = sum(p._local_tensor.numel() for p in params)
        n_global = sum(p.numel() for p in params)
        opt = build(params)
        tokens = torch.randint(0, 32000, (args.batch, args.seq), device=device,
                               generator=torch.Generator(device).manual_seed(rank))
        iters, steps = [], []
        for i in range(args.warmup + args.steps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(input_ids=tokens, labels=tokens).loss
            loss.backward()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            opt.step()
            end.record()
            opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            if i >= args.warmup:
                iters.append((time.perf_counter() - t0) * 1e3)
                steps.append(start.elapsed_time(end))
        held = state_bytes(opt)
        peak = torch.cuda.max_memory_allocated() / 2**30
        rows.append((label, statistics.median(steps), statistics.median(iters), held, held * 8 / n_local, peak,
                     loss.item()))
        if hasattr(opt, "close"):
            opt.close()
        del model, opt, params
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    if rank == 0:
        ref_step, ref_iter = rows[0][1], rows[0][2]
        print(f"\nFSDP2 on {world} x {torch.cuda.get_device_name()}: Llama-shaped {n_global / 1e9:.3f}B params "
              f"({n_local / 1e9:.3f}B per rank), batch {args.batch}x{args.seq} per rank, bf16 autocast, "
              f"torch {torch.__version__}")
        print("| configuration | optimizer step ms | x fused | iteration ms | x fused | optimizer GPU MiB per rank "
              "| bits/param (local) | peak GiB | last loss |")
        print("|---|---|---|---|---|---|---|---|---|")
        for label, s, it, held, bits, peak, loss in rows:
            print(f"| {label} | {s:.2f} | {s / ref_step:.2f} | {it:.1f} | {it / ref_iter:.2f} | {held / 2**20:.0f} "
                  f"| {bits:.2f} | {peak:.1f} | {loss:.3f} |")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
