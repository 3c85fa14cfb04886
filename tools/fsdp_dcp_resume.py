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
of how many differed (the 8B offloaded run with release differs in some runs only: docs/benchmarks-journal.md
sections 35 and 36); ``--wrap-option KEY=VALUE`` passes further ``wrap()`` options to optstate
contenders; ``--trace`` checks the load itself.

``--determinism W`` skips the checkpoint: ``--repeats`` runs of W windows from one seed, each window
after a host synchronisation, compared with the first run step by step (a device checksum of every
parameter after every step, without a host synchronisation) and at the end tensor by tensor, element
by element. ``--delay STREAM=CYCLES`` adds runs in which the GPU spins on the upload, write-back or
compute stream before each of its copies or launches (a missing wait then shows as a difference);
``--deterministic`` turns on ``torch.use_deterministic_algorithms`` (attention's backward then has
no atomics: a run that still differs is not the model's own nondeterminism).
"""
import argparse
import ast
import contextlib
import json
import os
import re
import shutil
import time

# pinned host memory registered by 8 threads: offloaded state is pinned in the first iteration, ~5x faster
# this way than with cudaHostAlloc (tools/pin_bench.py; unless the caller set the variable)
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "pinned_use_cuda_host_register:True,pinned_num_register_threads:8")

import torch  # noqa: E402
import torch.distributed as dist

BLOCK = 1 << 16  # bytes per fingerprint checksum


def param_sums(model) -> torch.Tensor:
    """A checksum of each local parameter shard's bits, queued on the device (read at the end)."""
    return torch.stack([(p._local_tensor if hasattr(p, "_local_tensor") else p).detach().reshape(-1)
                        .view(torch.int16).sum(dtype=torch.int64) for p in model.parameters()])


def train(model, opt, first, steps, batch, seq, vocab, sums=None):
    """``steps`` steps on tokens drawn from (step, rank); the losses. ``sums``: a list that gets
    :func:`param_sums` after each step."""
    losses = []
    for s in range(first, first + steps):
        gen = torch.Generator(device="cuda").manual_seed(s * 1000 + dist.get_rank())
        tokens = torch.randint(0, vocab, (batch, seq), device="cuda", generator=gen)
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        if sums is not None:
            sums.append(param_sums(model))
    return torch.stack(losses).tolist()


def block_sums(t: torch.Tensor, device="cuda") -> torch.Tensor:
    """Position-weighted checksums of each :data:`BLOCK` bytes of ``t`` (the last block zero-padded),
    taken on ``device`` in 64 MiB pieces; a CPU int64 vector."""
    raw = t.detach().reshape(-1).view(torch.uint8)
    weights = torch.arange(BLOCK, device=device, dtype=torch.int64) % 65521 + 1
    sums = []
    for start in range(0, raw.numel(), 1 << 26):
        chunk = raw[start:start + (1 << 26)].to(device, non_blocking=False)
        if chunk.numel() % BLOCK:
            chunk = torch.cat([chunk, chunk.new_zeros(BLOCK - chunk.numel() % BLOCK)])
        sums.append((chunk.view(-1, BLOCK).to(torch.int64) * weights).sum(1))
    return torch.cat(sums).cpu() if sums else torch.zeros(0, dtype=torch.int64)


def fingerprints(model, opt):
    """:func:`block_sums` of every local tensor (cheaper than clones, and they say where two runs differ)."""
    return {name: block_sums(t) for name, t in local_tensors(model, opt, clone=False).items()}


def diverged(a, b):
    """Names whose fingerprints differ (or exist in one only)."""
    return sorted(k for k in set(a) | set(b) if k not in a or k not in b or not torch.equal(a[k], b[k]))


def describe(a, b, device="cuda") -> dict:
    """Where two versions of one tensor differ, element by element (bits compared): how many, the
    first and last index, a few pairs, and for floats the median ratio (a uniform rescale shows)."""
    a, b = a.detach().reshape(-1).to(device), b.detach().reshape(-1).to(device)
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    idx = (a.view(as_int) != b.view(as_int)).nonzero().flatten()
    out = {"dtype": str(a.dtype).replace("torch.", ""), "numel": a.numel(), "differ": idx.numel()}
    if idx.numel():
        take = sorted(set(idx[:4].tolist() + idx[-2:].tolist()))
        out.update(first=int(idx[0]), last=int(idx[-1]),
                   pairs=[(i, a[i].item(), b[i].item()) for i in take])
        if a.is_floating_point():
            ratio = (b[idx].double() / a[idx].double()).cpu()  # median on the CPU (deterministic mode)
            out.update(ratio_median=float(ratio.median()), ratio_min=float(ratio.min()), ratio_max=float(ratio.max()))
    return out


def local_tensors(model, opt, clone=True):
    """Every local parameter shard and optimizer-state tensor as DCP sees them, by name (cloned),
    encoded payloads included (nested dicts are walked: ``state.<fqn>.exp_avg.encoded.payload.codes``)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    copy = (lambda t: t.clone()) if clone else (lambda t: t)
    out = {f"param.{n}": copy((p._local_tensor if hasattr(p, "_local_tensor") else p).detach())
           for n, p in model.named_parameters()}

    def walk(value, name):
        if isinstance(value, dict):
            for key, sub in value.items():
                walk(sub, f"{name}.{key}")
        elif isinstance(value, torch.Tensor):
            out[name] = copy(value._local_tensor if hasattr(value, "_local_tensor") else value)

    for fqn, entry in get_optimizer_state_dict(model, opt)["state"].items():
        walk(entry, f"state.{fqn}")
    return out


def layers_of(names):
    """How many of these tensor names belong to each decoder layer (``layers.N.``), else to "other"."""
    counts = {}
    for name in names:
        match = re.search(r"layers\.(\d+)\.", name)
        key = match.group(1) if match else "other"
        counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: (kv[0] == "other", int(kv[0]) if kv[0].isdigit() else 0)))


def parse_delay(spec: str) -> dict:
    """``--delay`` ``STREAM=CYCLES[+STREAM=CYCLES...]`` (STREAM: h2d, d2h, compute) -> {stream: cycles}."""
    out = {}
    for part in spec.split("+"):
        key, sep, value = part.partition("=")
        if not sep or key not in ("h2d", "d2h", "compute"):
            raise ValueError(f"--delay takes STREAM=CYCLES joined by '+' (STREAM: h2d, d2h, compute), got {spec!r}")
        out[key] = int(float(value))
    return out


DELAYS: dict = {}  # the current run's GPU spins per stream (--delay): an ordering race shows as a difference


def install_delays() -> None:
    """Spin each stream for ``DELAYS[stream]`` cycles before its work in the offloaded step: the
    write-back stream before each write-back, the upload stream before each ring chunk's or staged
    slab's upload, the compute stream before each update launch. Correct ordering makes the bits independent of
    these spins; a missing wait turns a rare race into a regular difference."""
    from optstate_core.schedule import timetable
    from optstate_core.step import fused_launch

    schedule = timetable.StepSchedule
    write_back, stream_chunk, upload = schedule._write_back, schedule._stream_chunk, schedule._upload
    launch = fused_launch.KernelLauncher.launch

    def spin(stream, key):
        if DELAYS.get(key):
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                torch.cuda._sleep(DELAYS[key])

    def delayed_write_back(self, streams, *a, **k):
        if streams.cuda:
            spin(streams.d2h, "d2h")
        return write_back(self, streams, *a, **k)

    def delayed_stream_chunk(self, bucket, *a, **k):
        streams = self.streams(bucket.params[0].device)
        if streams.cuda:
            spin(streams.h2d, "h2d")
        return stream_chunk(self, bucket, *a, **k)

    def delayed_upload(self, bucket, *a, **k):
        streams = self.streams(bucket.params[0].device)
        if streams.cuda:
            spin(streams.h2d, "h2d")
        return upload(self, bucket, *a, **k)

    def delayed_launch(self, bucket, *a, **k):
        if bucket.params[0].device.type == "cuda":
            spin(None, "compute")
        return launch(self, bucket, *a, **k)

    timetable.StepSchedule._write_back = delayed_write_back
    timetable.StepSchedule._stream_chunk = delayed_stream_chunk
    timetable.StepSchedule._upload = delayed_upload
    fused_launch.KernelLauncher.launch = delayed_launch


def repeat_runs(args, c, name, fresh, shape):
    """``--determinism W``: ``--repeats`` fresh runs from the same seed, each W windows of
    ``--steps`` steps with a host synchronisation (``state_dict()``, as a checkpoint save) before
    each window. Every rank prints one ``DET {json}`` per run against the first: the first step
    whose loss differs, after which window the tensors first differ (fingerprints at the end, and
    with ``--window-prints`` at each window's start), the tensors whose bytes changed between two
    reads at the end (after a synchronisation: a read racing a write), and each differing tensor
    element by element. Returns how many runs differed from the first on any rank."""
    rank = dist.get_rank()
    run = (args.batch, args.seq, shape.vocab)
    reference, differed = None, 0
    plan = [{}] + [parse_delay(spec) for spec in args.delay for _ in range(args.repeats)] if args.delay \
        else [{}] * args.repeats
    for r, delays in enumerate(plan):
        DELAYS.clear()
        DELAYS.update(delays)
        model, opt = fresh(c, seed=0)
        losses, windows, queued_sums = [], [], []
        names = [n for n, _ in model.named_parameters()]
        t0 = time.perf_counter()
        for w in range(args.determinism):
            opt.state_dict()  # waits for queued write-backs: the host synchronisation a save makes
            torch.cuda.synchronize()
            if w and args.window_prints:
                windows.append(fingerprints(model, opt))
            losses += train(model, opt, w * args.steps, args.steps, *run, sums=queued_sums)
        seconds = time.perf_counter() - t0
        step_sums = torch.stack(queued_sums).cpu()  # [steps, parameters]: the one read of them
        windows.append(fingerprints(model, opt))
        torch.cuda.synchronize()
        time.sleep(0.1)
        unstable = diverged(windows[-1], fingerprints(model, opt))  # a read that raced a write shows here
        final = local_tensors(model, opt, clone=reference is None)  # the first run keeps a copy
        if reference is None:
            reference = (losses, windows, final, step_sums)
        moved = (reference[3] != step_sums).any(1).nonzero().flatten().tolist()  # steps after which params differ
        first_params = [] if not moved else \
            [names[i] for i in (reference[3][moved[0]] != step_sums[moved[0]]).nonzero().flatten().tolist()]
        other = [i for i, (a, b) in enumerate(zip(reference[0], losses)) if a != b]
        per_window = [diverged(a, b) for a, b in zip(reference[1], windows)]
        first_window = next((i + 1 if args.window_prints else args.determinism
                             for i, lost in enumerate(per_window) if lost), None)
        last = per_window[-1]
        details = {n: describe(reference[2][n], final[n]) for n in last[:8] if n in final and n in reference[2]}
        differs = bool(other) or first_window is not None or bool(moved)
        print("DET " + json.dumps({
            "optimizer": name, "rank": rank, "run": r, "delays": delays, "model": args.model,
            "windows": args.determinism,
            "steps": args.steps, "differs_from_run0": differs, "first_differing_step": other[0] if other else None,
            "state_first_differs_after_window": first_window,
            "differing_per_window": [len(lost) for lost in per_window], "differing_at_end": len(last),
            "changed_between_two_reads": unstable[:6],
            "params_first_differ_after_step": moved[0] if moved else None,
            "params_differing_then": len(first_params), "params_then_by_layer": layers_of(first_params),
            "params_then": first_params[:24],
            "by_layer": layers_of(last), "names": last[:12], "details": details, "tensors": len(final),
            "losses": losses, "seconds": round(seconds, 1)}), flush=True)
        count = torch.tensor([int(differs)], device="cuda")
        dist.all_reduce(count)
        differed += int(count.item() > 0)
        if hasattr(opt, "close"):
            opt.close()
        del model, opt, final, step_sums, queued_sums
        torch.cuda.empty_cache()
        dist.barrier()
    return differed


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
    parser.add_argument("--determinism", type=int, default=0, metavar="W",
                        help="instead of the round trip: --repeats fresh runs from one seed, W windows of --steps "
                             "steps each after a host synchronisation; DET lines say where runs differ")
    parser.add_argument("--deterministic", action="store_true",
                        help="torch.use_deterministic_algorithms(True) (and CUBLAS_WORKSPACE_CONFIG): attention's "
                             "backward without atomics, uninitialized memory filled with NaN; a run that still "
                             "differs is not the model's own nondeterminism")
    parser.add_argument("--window-prints", action="store_true",
                        help="with --determinism: fingerprints at each window's start too (where the state first "
                             "differs; adds a pause per window)")
    parser.add_argument("--delay", action="append", default=[], metavar="STREAM=CYCLES[+...]",
                        help="with --determinism: after a first run without, --repeats runs with the GPU spinning "
                             "this many cycles on a stream (h2d, d2h, compute) before each of its copies or "
                             "launches (repeatable): a missing wait then shows as a difference")
    args = parser.parse_args()
    if args.delay and not args.determinism:
        parser.error("--delay needs --determinism")
    for spec in args.delay:
        try:
            parse_delay(spec)
        except ValueError as e:
            parser.error(str(e))
    if args.determinism < 0:
        parser.error(f"--determinism must be at least 0, got {args.determinism}")
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
    if args.deterministic:  # before the first cuBLAS call
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    from optstate_core.apps import contenders
    from optstate_core.apps.llama import NAMED_SHAPES, build_model, shard_each_layer
    from optstate_core.apps.chunked_loss import use_chunked_loss
    if args.delay:
        install_delays()

    shape = NAMED_SHAPES[args.model]

    def fresh(c, seed):
        model = use_chunked_loss(build_model(shape, "cuda", c.weights, checkpointing=True, seed=seed,
                                             shard=shard_each_layer))
        return model, contenders.build(c, list(model.parameters()), model,
                                       max_grad_norm=1.0 if c.release else None, **options)

    for name in args.optimizers.split(","):
        c = contenders.parse(name)
        if args.determinism:
            count = repeat_runs(args, c, name, fresh, shape)
        else:
            count = sum(round_trip(args, c, name, fresh, shape, r) > 0 for r in range(args.repeats))
        if rank == 0:
            print("SUMMARY " + json.dumps({"optimizer": name, "model": args.model, "repeats": args.repeats,
                                           "determinism_windows": args.determinism, "runs_that_differed": count,
                                           "options": options, "delays": args.delay,
                                           "deterministic": args.deterministic}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
