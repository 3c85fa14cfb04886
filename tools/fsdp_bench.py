"""FSDP2 benchmark on several GPUs: per-rank optimizer memory and step time, optstate vs
torch.optim.AdamW(fused=True) under the same FSDP2 setup.

    torchrun --nproc_per_node 2 tools/fsdp_bench.py [--layers 16] [--steps 8]

A Llama-shaped model from a config (hidden 2048, vocab 32000), each decoder layer and the root
wrapped with ``fully_shard``, fp32 master weights, bf16 autocast, random tokens.

    torchrun --nproc_per_node 2 tools/fsdp_bench.py --model 8b --batch 1 --seq 2048 \
        --optimizers bf16w-4bit-lean,bf16w-4bit-lean-offload

Memory figures of the rows after the first carry the previous configuration's weights (torch's
FSDP2 keeps a trained model referenced): run one configuration per invocation to compare memory.

``--optimizers`` takes benchmark contender names instead (``optstate bench --peak-bytes``'s:
``adamw``, presets with ``+release``/``+offload``/``+budget<bytes>``; ``bf16w-*`` presets get bf16
weights and gradient release, clipping at 1.0); ``--model`` a named shape (``0.95b``, ``8b``, ``70b``),
built on the meta device, sharded there and materialized shard by shard on each rank (``70b``:
Llama-3-70B's shapes never exist whole anywhere), with activation checkpointing. ``none`` / ``none-bf16`` have no optimizer and free each
sharded gradient in the hook FSDP2 calls after its reduce-scatter: the lowest peak any gradient
release can reach on that model and batch (what is left is weights, activations and FSDP2's own
buffers).

Peaks are per phase (forward with the loss, backward, step with ``zero_grad``), each from
``torch.cuda.reset_peak_memory_stats()`` at the phase's start, the highest over the timed
iterations: they tell whether a lower gradient footprint can lower the iteration's peak at all.
"""
import argparse
import functools
import gc
import json
import os
import statistics
import time

# pinned host memory registered by 8 threads: offloaded state is pinned in the first iteration, ~5x faster
# this way than with cudaHostAlloc (tools/pin_bench.py; unless the caller set the variable)
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "pinned_use_cuda_host_register:True,pinned_num_register_threads:8")

import torch  # noqa: E402
import torch.distributed as dist

import optstate_core as oc
from optstate_core.apps.measure import state_bytes
from optstate_core.apps.e2e import build_model


def profile_iterations(model, opt, tokens, path, rank):
    """torch.profiler over 3 iterations; rank 0 writes the ops table (by self CPU time, then CUDA time)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            with torch.profiler.record_function("fwd"), torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(input_ids=tokens, labels=tokens).loss
            with torch.profiler.record_function("bwd"):
                loss.backward()
            with torch.profiler.record_function("step"):
                opt.step()
            opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
    if rank == 0:
        table = prof.key_averages()
        with open(path, "w") as f:
            f.write(table.table(sort_by="self_cpu_time_total", row_limit=40))
            f.write("\n")
            f.write(table.table(sort_by="self_cuda_time_total", row_limit=25))
        trace = path + ".trace.json"
        prof.export_chrome_trace(trace)
        import subprocess
        import sys
        with open(path, "a") as f:
            f.write("\n" + subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "trace_timeline.py"),
                                           trace, "--kernels", "step"], capture_output=True, text=True).stdout)
        os.remove(trace)
    import cProfile
    import io
    import pstats

    cprof = cProfile.Profile()
    for _ in range(3):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        torch.cuda.synchronize()
        cprof.enable()
        opt.step()
        cprof.disable()
        opt.zero_grad(set_to_none=True)
    if rank == 0:
        out = io.StringIO()
        pstats.Stats(cprof, stream=out).sort_stats("cumulative").print_stats(45)
        pstats.Stats(cprof, stream=out).sort_stats("tottime").print_stats(30)
        with open(path, "a") as f:
            f.write("\n\ncProfile of opt.step() (3 steps)\n" + out.getvalue())


#: the ``--optimizers`` name of torch FSDP2's own offload (``CPUOffloadPolicy``): fp32 shards in pinned
#: host memory, bf16 parameters and fp32 gradient reduction on the GPU, torch AdamW stepping on the CPU
CPU_OFFLOAD = object()


def all_ranks_max(value: float) -> float:
    """The largest of every rank's ``value``."""
    t = torch.tensor([float(value)], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def resident_set_gib() -> float:
    """This process's resident host memory (pinned state included), GiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024 / 2**30
    return 0.0


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--profile", default=None,
                        help="write a torch.profiler table of 3 optstate int8 iterations (rank 0) to this file")
    parser.add_argument("--only", default=None, help="comma-separated configuration labels to run (default: all)")
    parser.add_argument("--optimizers", default=None, help="contender names (see the module doc) instead of the table")
    parser.add_argument("--model", default=None, help="a named Llama shape for --optimizers (default: 0.95b)")
    parser.add_argument("--plain-loss", action="store_true",
                        help="with --model: the model's own loss over whole logits (default: the chunked loss, "
                             "optstate_core.apps.chunked_loss, which never holds them)")
    parser.add_argument("--json", default=None, help="rank 0 appends each row to this JSON-lines file as it ends")
    args = parser.parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    device = torch.device("cuda")
    from optstate_core.apps.llama import shard_each_layer

    configs = {
        "torch AdamW fused": lambda ps: torch.optim.AdamW(ps, fused=True),
        "optstate int8 resident": lambda ps: oc.wrap(torch.optim.AdamW(ps, fused=True), "8bit"),
        "optstate int8 offloaded": lambda ps: oc.wrap(torch.optim.AdamW(ps, fused=True), "8bit", offload=True),
        # updates each local shard in the hook FSDP2 calls after its reduce-scatter; clipping "previous"
        "optstate int8 + gradient release": lambda ps: oc.wrap(torch.optim.AdamW(ps, fused=True), "8bit",
                                                               release_gradients=True, max_grad_norm=1.0),
    }
    if args.only:
        configs = {k: v for k, v in configs.items() if k in args.only.split(",") or k == "torch AdamW fused"}
    shape = None
    if args.optimizers:
        from optstate_core.apps import contenders
        from optstate_core.apps.llama import NAMED_SHAPES
        shape = NAMED_SHAPES[args.model or "0.95b"]
        configs = {name: CPU_OFFLOAD if name == "fsdp-cpu-offload" else contenders.parse(name)
                   for name in args.optimizers.split(",")}
    vocab = shape.vocab if shape is not None else 32000
    rows = []
    for label, build in configs.items():
        torch.manual_seed(0)
        offload = build is CPU_OFFLOAD
        fsdp_options = {}
        if offload:  # torch's own offload: fp32 shards in host memory, bf16 compute, AdamW on the CPU
            from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy
            fsdp_options = {"offload_policy": CPUOffloadPolicy(),
                            "mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}
        shard = functools.partial(shard_each_layer, **fsdp_options)

        if shape is not None:  # a contender: its weights dtype, checkpointing, its own build, sharded on the
            from optstate_core.apps.llama import build_model as build_named  # meta device (70b fits no rank whole)
            if offload:  # shards built on the host, buffers (rotary frequencies) on the GPU
                model = build_named(shape, "cpu", torch.float32, checkpointing=True, shard=shard)
                for module in model.modules():
                    for key, buf in module._buffers.items():
                        if buf is not None:
                            module._buffers[key] = buf.to(device)
            else:
                model = build_named(shape, device, build.weights, checkpointing=True, shard=shard)
            if not args.plain_loss:
                from optstate_core.apps.chunked_loss import use_chunked_loss
                use_chunked_loss(model)
        else:
            model = build_model(2048, args.layers, 32000, 5632, device)
            shard(model)
        params = list(model.parameters())
        n_local = sum(p._local_tensor.numel() for p in params)
        n_global = sum(p.numel() for p in params)
        undo = None
        if offload:
            opt = torch.optim.AdamW(params, lr=contenders.LR)
        elif shape is not None:
            opt = contenders.build(build, params, model, max_grad_norm=1.0 if build.release else None)
            if opt is None:  # none / none-bf16: each gradient freed after its reduce-scatter, nothing updated
                undo = contenders.free_gradients_in_hooks(params)
        else:
            opt = build(params)
        tokens = torch.randint(0, vocab, (args.batch, args.seq), device=device,
                               generator=torch.Generator(device).manual_seed(rank))
        iters, steps, hosts, after_backward, losses = [], [], [], [], []
        phase_peaks = [0.0, 0.0, 0.0]  # forward + loss, backward, step + zero_grad
        autocast = shape is None or (not offload and build.autocast)
        for i in range(args.warmup + args.steps):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                loss = model(input_ids=tokens, labels=tokens).loss
            peaks = [torch.cuda.max_memory_allocated()]
            torch.cuda.reset_peak_memory_stats()
            loss.backward()
            peaks.append(torch.cuda.max_memory_allocated())
            torch.cuda.reset_peak_memory_stats()
            if i >= args.warmup:  # what backward leaves for step(): gradients (none if released), leftovers
                after_backward.append(torch.cuda.memory_allocated() / 2**30)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            h0 = time.perf_counter()
            if opt is not None:
                opt.step()
            h1 = time.perf_counter()
            end.record()
            if opt is not None:
                opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            peaks.append(torch.cuda.max_memory_allocated())
            losses.append(loss.item())
            if i == 0:
                first_iteration = time.perf_counter() - t0
            if i >= args.warmup:
                phase_peaks = [max(a, b / 2**30) for a, b in zip(phase_peaks, peaks)]
                iters.append((time.perf_counter() - t0) * 1e3)
                steps.append(start.elapsed_time(end))
                hosts.append((h1 - h0) * 1e3)
        if args.profile and label == "optstate int8 resident":
            profile_iterations(model, opt, tokens, args.profile, rank)
        held = state_bytes(opt) if hasattr(opt, "state") else 0
        host = opt.memory_report()["host_bytes"] if hasattr(opt, "memory_report") else 0
        if offload:  # torch AdamW's state lives beside its host shards
            held, host = 0, state_bytes(opt)
        rows.append((label, statistics.median(steps), statistics.median(hosts), statistics.median(iters), held,
                     held * 8 / n_local, phase_peaks, max(after_backward), loss.item()))
        report = {"label": label, "world": world, "device": torch.cuda.get_device_name(), "model": args.model,
                  "batch": args.batch, "seq": args.seq, "chunked_loss": shape is not None and not args.plain_loss,
                  "iteration_ms": statistics.median(iters), "iteration_ms_all": iters, "step_ms": statistics.median(steps),
                  "first_iteration_s": first_iteration, "peak_gib": max(phase_peaks), "phase_peaks_gib": phase_peaks,
                  "max_peak_gib_over_ranks": all_ranks_max(max(phase_peaks)),
                  "state_gpu_gib": held / 2**30, "state_host_gib": host / 2**30,
                  "max_state_host_gib_over_ranks": all_ranks_max(host / 2**30),
                  "rss_gib": resident_set_gib(), "max_rss_gib_over_ranks": all_ranks_max(resident_set_gib()),
                  "tokens_per_s": world * args.batch * args.seq / (statistics.median(iters) / 1e3),
                  "losses": losses, "params": n_global, "torch": torch.__version__}
        if rank == 0:
            print("ROW " + json.dumps(report), flush=True)
            if args.json:
                with open(args.json, "a") as f:
                    f.write(json.dumps(report) + "\n")
        if hasattr(opt, "close"):
            opt.close()
        if undo is not None:
            undo()
        del model, opt, params, loss
        gc.collect()  # torch's FSDP2 still keeps a trained model referenced after this (docs/benchmarks-journal.md section
        torch.cuda.empty_cache()  # 23): the next rows carry its weights, so compare memory one configuration a run
        torch.cuda.reset_peak_memory_stats()
    if rank == 0:
        ref_step, ref_iter = rows[0][1] or 1e-9, rows[0][3]
        how = "bf16 autocast" if shape is None else f"shape {args.model or '0.95b'}, activation checkpointing, " \
            "each row in its contender's weights dtype, ratios to the first row"
        print(f"\nFSDP2 on {world} x {torch.cuda.get_device_name()}: Llama-shaped {n_global / 1e9:.3f}B params "
              f"({n_local / 1e9:.3f}B per rank), batch {args.batch}x{args.seq} per rank, {how}, "
              f"torch {torch.__version__}")
        print("| configuration | optimizer step ms | x fused | step() host ms | iteration ms | x fused "
              "| optimizer GPU MiB per rank | bits/param (local) | peak GiB | peak in forward / backward / step GiB "
              "| allocated after backward GiB | last loss |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for label, s, host, it, held, bits, peaks, after, loss in rows:
            print(f"| {label} | {s:.2f} | {s / ref_step:.2f} | {host:.2f} | {it:.1f} | {it / ref_iter:.2f} "
                  f"| {held / 2**20:.0f} | {bits:.2f} | {max(peaks):.2f} | {' / '.join(f'{p:.2f}' for p in peaks)} "
                  f"| {after:.2f} | {loss:.3f} |")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
