"""Weight streaming on one GPU: a Llama shape trained with its decoder layers' weights streamed from
host memory, against the same run with the weights resident. One case per call.

Usage (from a checkout, on a GPU)::

    PYTHONPATH=.:integrations python tools/stream_gpu.py MODE CAP_GB MICRO_BATCH [SHAPE [STEPS [SEQ [RESIDENT [BUDGET]]]]] [--offload-activations]
    python tools/stream_gpu.py resident 0 1 8b 6; python tools/stream_gpu.py streamed 12 1 8b 6

MODE ``resident``: preset ``bf16w-4bit-lean`` (state on the GPU), weights resident; ``streamed``: preset
``bf16w-4bit-lean-offload`` (state in host memory) and ``stream_weights`` on all decoder layers but the
last RESIDENT (default 0), which stay on the device; with BUDGET (e.g. ``95GiB``) the state is
``bf16w-4bit-lean`` with ``gpu_budget=BUDGET`` instead (resident up to it, the rest in host memory). Both: bf16 weights, gradient
release, non-reentrant activation checkpointing, the chunked loss, lr 1e-4, one batch of random
tokens every step (the loss falls as the model learns it). ``--offload-activations``: the layer inputs
that checkpointing keeps go to host memory between forward and recompute (``offload_activations``). CAP_GB (1e9 bytes; 0:
none) applies from the start: a streamed model is built one layer at a time into host memory
(``apps.llama.build_model(stream=True)``), so it never is on the GPU whole. Prints one JSON line: s/step
(wall clock over steps 3..STEPS, the device synchronised at both ends), tokens/s, the peak
(``max_memory_allocated``), the streamed bytes, the process RSS and the losses.
"""
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True,pinned_use_cuda_host_register:True,"
                                                 "pinned_num_register_threads:8")
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "integrations")]


def rss_gib() -> float:
    with open("/proc/self/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))
    return round(kb / 2**20, 2)


def main(mode: str, cap_gb: float, micro_batch: int, shape: str = "8b", steps: int = 6, seq: int = 2048,
         resident: int = 0, budget: str = "", offload_activations: bool = False) -> dict:
    import optstate_core as oc
    from optstate_core.apps.chunked_loss import use_chunked_loss
    from optstate_core.apps.llama import NAMED_SHAPES, build_model

    if cap_gb:  # from the start: the model is built under it too
        torch.cuda.set_per_process_memory_fraction(cap_gb * 1e9 / torch.cuda.get_device_properties(0).total_memory)
    streamed = mode == "streamed"
    started = time.perf_counter()
    model = build_model(NAMED_SHAPES[shape], "cuda", torch.bfloat16, checkpointing=True, stream=streamed)
    use_chunked_loss(model)
    preset = "bf16w-4bit-lean-offload" if streamed and not budget else "bf16w-4bit-lean"
    extra = {"gpu_budget": budget} if budget else {}
    built = time.perf_counter()
    opt = oc.wrap(torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0), preset, release_gradients=True,
                  **extra)
    layers = list(model.model.layers)
    if streamed and resident:  # the last RESIDENT layers come back to stay
        oc.stream_weights(model, opt, layers=layers[len(layers) - resident:]).close()
    stream = oc.stream_weights(model, opt, layers=layers[:len(layers) - resident]) if streamed else None
    acts = oc.offload_activations(model) if offload_activations else None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    ids = torch.randint(0, 32000, (micro_batch, seq), generator=torch.Generator().manual_seed(0)).cuda()
    losses, t0, status = [], None, "ok"
    try:
        for step in range(steps):
            if step == 2:
                torch.cuda.synchronize()
                t0 = time.perf_counter()
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(round(loss.item(), 4))
            print(f"step {step}: loss {losses[-1]}, {time.perf_counter() - started:.1f} s since the build began",
                  file=sys.stderr, flush=True)
        torch.cuda.synchronize()
    except torch.OutOfMemoryError:
        status = "OOM"
    step_s = (time.perf_counter() - t0) / (steps - 2) if status == "ok" else None
    report = opt.memory_report()
    return {"case": [mode, cap_gb, micro_batch, shape, seq, resident] + (["offload-activations"] if acts else []),
            "status": status, "step_s": step_s and round(step_s, 3),
            "tokens_per_s": step_s and round(micro_batch * seq / step_s), "losses": losses,
            "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2), "rss_gib": rss_gib(),
            "build_s": round(built - started, 1), "state_device_gib": round(report["device_bytes"] / 2**30, 2),
            "state_host_gib": round(report["host_bytes"] / 2**30, 2),
            "streamed_host_gib": stream and round(stream.host_bytes() / 2**30, 2),
            "h2d_gib": stream and round(stream.h2d_bytes / 2**30, 1), "d2h_gib": stream and round(stream.d2h_bytes / 2**30, 1),
            "activations_pinned_gib": acts and round(acts.pooled_bytes() / 2**30, 2),
            "activations_d2h_gib": acts and round(acts.d2h_bytes / 2**30, 1)}


if __name__ == "__main__":
    argv = [a for a in sys.argv if a != "--offload-activations"]
    if len(argv) < 4 or argv[1] not in ("resident", "streamed"):
        sys.exit(__doc__)
    rest = argv[4:5] + [int(a) for a in argv[5:8]] + argv[8:9]
    print(json.dumps(main(argv[1], float(argv[2]), int(argv[3]), *rest,
                          offload_activations="--offload-activations" in sys.argv)), flush=True)
