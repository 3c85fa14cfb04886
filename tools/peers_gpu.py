"""Weight streaming's peers on one GPU (issue 58): the run of ``tools/stream_gpu.py`` (a named Llama
shape, bf16 compute, non-reentrant activation checkpointing, AdamW lr 1e-4 without weight decay, one
batch of random tokens every step) trained by the two systems the issue names. One case per call.

Usage (from a checkout, on a GPU; DeepSpeed installed from wheels, tools/README.md)::

    PYTHONPATH=.:integrations python tools/peers_gpu.py PEER SHAPE MICRO_BATCH SEQ STEPS [LOSS]
    python tools/peers_gpu.py fsdp2-cpuoffload 3b 1 2048 6

PEER ``fsdp2-cpuoffload``: torch FSDP2 in a one-rank NCCL group, each decoder layer then the root
under ``fully_shard`` with ``CPUOffloadPolicy(pin_memory=True)`` and bf16 parameters / fp32 reduction:
fp32 parameters and gradients in pinned host memory, ``torch.optim.AdamW`` (torch's default
implementation) stepping on the CPU; built on the meta device, sharded, made in host memory from
draws on the GPU. ``deepspeed-zero3-offload``: DeepSpeed ZeRO-3 in one process, parameters and
optimizer offloaded to pinned host memory, bf16, ``DeepSpeedCPUAdam`` (AdamW mode), built under
``deepspeed.zero.Init`` (never whole on the GPU); the JIT build of its cpu_adam op is timed apart
(``cpu_adam_build_s``, not in ``build_s``). Both: N(0, 0.02) matrices and ones for norms, as
``apps.llama.build_model``. LOSS ``chunked`` (default): ``apps.chunked_loss`` as stream_gpu.py uses it
(under ZeRO-3 the lm_head weight it reads outside lm_head's forward is registered as the model's
external parameter); ``plain``: the model's own loss.

Prints one JSON line with stream_gpu.py's fields (s/step over steps 3..STEPS, wall clock with the
device synchronised at both ends; tokens/s; ``max_memory_allocated``; RSS; losses), ``peer``,
``loss``, the optimizer's class and the peak RSS. An out-of-memory error on the GPU or the host gives
status ``OOM`` (a process the kernel kills for memory prints nothing). Progress goes to stderr.
"""
import argparse
import contextlib
import json
import os
import socket
import sys
import time
from pathlib import Path

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True,pinned_use_cuda_host_register:True,"
                                                 "pinned_num_register_threads:8")  # as stream_gpu.py's
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "integrations")]

PEERS = ("fsdp2-cpuoffload", "deepspeed-zero3-offload")
LOSSES = ("chunked", "plain")
LR = 1e-4


def count(least: int):
    """An argparse type: an integer at least ``least``."""
    def parse(text: str) -> int:
        if not text.isdigit() or int(text) < least:
            raise argparse.ArgumentTypeError(f"must be an integer >= {least}, got {text!r}")
        return int(text)
    return parse


def parse_args(argv=None) -> argparse.Namespace:
    from optstate_core.apps.llama import NAMED_SHAPES

    p = argparse.ArgumentParser(prog="peers_gpu.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("peer", metavar="PEER", choices=PEERS, help=" or ".join(PEERS))
    p.add_argument("shape", metavar="SHAPE", choices=sorted(NAMED_SHAPES), help=", ".join(NAMED_SHAPES))
    p.add_argument("micro_batch", metavar="MICRO_BATCH", type=count(1))
    p.add_argument("seq", metavar="SEQ", type=count(1))
    p.add_argument("steps", metavar="STEPS", type=count(3), help="at least 3: steps 3..STEPS are timed")
    p.add_argument("loss", metavar="LOSS", nargs="?", default="chunked", choices=LOSSES)
    return p.parse_args(argv)


def proc_gib(field: str) -> float:
    """A memory figure of /proc/self/status (VmRSS, VmHWM) in GiB."""
    with open("/proc/self/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith(field + ":"))
    return round(kb / 2**20, 2)


def one_rank_env() -> None:
    """The environment of a one-process group: rank 0 of 1 on a free local port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(s.getsockname()[1]), "RANK": "0", "WORLD_SIZE": "1",
               "LOCAL_RANK": "0"}
    for key, value in env.items():
        os.environ.setdefault(key, value)


def hf_config(shape):
    """The Hugging Face Llama config ``apps.llama.build_model`` builds ``shape`` from."""
    from transformers import LlamaConfig

    fields = {k: v for k, v in shape.hf_config().items() if k != "model_type"}
    return LlamaConfig(**fields, max_position_embeddings=8192, use_cache=False)


def materialise(model, config, draw_device, buffer_device, seed: int = 0):
    """A meta ``model`` (sharded by FSDP2 or not) made in host memory: N(0, 0.02) for matrices, ones
    for norms, drawn per parameter on ``draw_device`` (a GPU draws billions in seconds) into each
    local shard; rotary buffers recomputed on ``buffer_device``. Returns ``model``."""
    from optstate_core.apps.llama import reset_rotary

    model.to_empty(device="cpu")
    gen = torch.Generator(device=draw_device).manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            local = getattr(p, "_local_tensor", p)  # a DTensor's own shard
            if p.dim() < 2:
                local.fill_(1.0)
            elif local.device == torch.device(draw_device):
                local.normal_(0.0, 0.02, generator=gen)
            else:
                local.copy_(torch.empty_like(local, device=draw_device).normal_(0.0, 0.02, generator=gen))
        for module in model.modules():
            for key, buf in module._buffers.items():
                if buf is not None:
                    module._buffers[key] = buf.to(buffer_device)
    reset_rotary(model, config, buffer_device)
    return model


def fsdp2(shape, micro_batch: int, device, loss: str, backend: str = "nccl"):
    """FSDP2 with CPUOffloadPolicy: (one training step of ``ids``, the optimizer, notes)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy
    from transformers import LlamaForCausalLM

    from optstate_core.apps.chunked_loss import use_chunked_loss
    from optstate_core.apps.llama import enable_checkpointing, shard_each_layer

    one_rank_env()
    dist.init_process_group(backend, rank=0, world_size=1)
    config = hf_config(shape)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    shard_each_layer(model, offload_policy=CPUOffloadPolicy(pin_memory=True),
                     mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    materialise(model, config, device, device)
    enable_checkpointing(model)
    if loss == "chunked":
        use_chunked_loss(model)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)

    def step(ids):
        out = model(input_ids=ids, labels=ids).loss
        out.backward()
        opt.step()
        opt.zero_grad()
        return out
    return step, opt, {}


def ds_config(shape, micro_batch: int) -> dict:
    """ZeRO-3 with parameters and optimizer state in pinned host memory, bf16, AdamW on the CPU;
    buckets as the Hugging Face Trainer sets its "auto" values for this width."""
    h2 = shape.hidden * shape.hidden
    return {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": 1,
            "bf16": {"enabled": True}, "gradient_clipping": 0.0, "steps_per_print": 10**9,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": [0.9, 0.999], "eps": 1e-8,
                                                      "weight_decay": 0.0, "adam_w_mode": True}},
            "zero_optimization": {"stage": 3, "overlap_comm": True, "contiguous_gradients": True,
                                  "offload_param": {"device": "cpu", "pin_memory": True},
                                  "offload_optimizer": {"device": "cpu", "pin_memory": True},
                                  "reduce_bucket_size": h2, "stage3_prefetch_bucket_size": int(0.9 * h2),
                                  "stage3_param_persistence_threshold": 10 * shape.hidden}}


def zero3(shape, micro_batch: int, device, loss: str, backend=None):
    """DeepSpeed ZeRO-3 offload: (one training step of ``ids``, the CPU optimizer, notes)."""
    import deepspeed
    from deepspeed.ops.op_builder import CPUAdamBuilder
    from transformers import LlamaForCausalLM

    from optstate_core.apps.chunked_loss import use_chunked_loss
    from optstate_core.apps.llama import enable_checkpointing, reset_rotary

    t0 = time.perf_counter()
    CPUAdamBuilder().load()  # DeepSpeed's JIT build of cpu_adam (a load if already built)
    notes = {"cpu_adam_build_s": round(time.perf_counter() - t0, 1), "deepspeed": deepspeed.__version__}
    print(f"cpu_adam ready in {notes['cpu_adam_build_s']} s", file=sys.stderr, flush=True)
    one_rank_env()
    deepspeed.init_distributed(dist_backend=backend)
    config, ds = hf_config(shape), ds_config(shape, micro_batch)
    with deepspeed.zero.Init(config_dict_or_path=ds, remote_device="cpu", pin_memory=True):
        model = LlamaForCausalLM(config)
    reset_rotary(model, config, device)  # zero.Init made the rotary frequencies in bf16
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():  # gathered on the GPU one at a time, filled, partitioned back
            with deepspeed.zero.GatheredParameters([p], modifier_rank=0):
                if p.dim() >= 2:
                    p.normal_(0.0, 0.02, generator=gen)
                else:
                    p.fill_(1.0)
    enable_checkpointing(model)
    if loss == "chunked":
        use_chunked_loss(model)
        deepspeed.zero.register_external_parameter(model, model.lm_head.weight)
    engine, opt, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)

    def step(ids):
        out = engine(input_ids=ids, labels=ids).loss
        engine.backward(out)
        engine.step()
        return out
    return step, opt.optimizer, notes


BUILDERS = {"fsdp2-cpuoffload": fsdp2, "deepspeed-zero3-offload": zero3}


def out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is a GPU or host allocation failure."""
    text = str(error)
    return isinstance(error, (torch.OutOfMemoryError, MemoryError)) or "out of memory" in text \
        or "can't allocate memory" in text


def main(peer: str, shape_name: str, micro_batch: int, seq: int, steps: int, loss: str = "chunked") -> dict:
    from optstate_core.apps.llama import NAMED_SHAPES
    from optstate_core.apps.measure import state_bytes

    shape = NAMED_SHAPES[shape_name]
    torch.cuda.set_device(0)
    started = time.perf_counter()
    report = {"peer": peer, "case": [peer, shape_name, micro_batch, seq, loss], "loss": loss, "status": "ok",
              "step_s": None, "tokens_per_s": None, "losses": [], "params": shape.params, "torch": torch.__version__,
              "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"), "state_device_gib": 0.0,
              "streamed_host_gib": None, "h2d_gib": None, "d2h_gib": None}
    opt, t0 = None, None
    try:
        step, opt, notes = BUILDERS[peer](shape, micro_batch, "cuda", loss)
        built_s = time.perf_counter() - started - notes.get("cpu_adam_build_s", 0.0)
        report.update(notes, optimizer=type(opt).__name__, build_s=round(built_s, 1))
        print(f"built in {report['build_s']} s, RSS {proc_gib('VmRSS')} GiB", file=sys.stderr, flush=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        ids = torch.randint(0, min(32000, shape.vocab), (micro_batch, seq),
                            generator=torch.Generator().manual_seed(0)).cuda()
        for i in range(steps):
            if i == 2:
                torch.cuda.synchronize()
                t0 = time.perf_counter()
            report["losses"].append(round(step(ids).item(), 4))
            print(f"step {i}: loss {report['losses'][-1]}, {time.perf_counter() - started:.1f} s since the build "
                  f"began, RSS {proc_gib('VmRSS')} GiB", file=sys.stderr, flush=True)
        torch.cuda.synchronize()
        step_s = (time.perf_counter() - t0) / (steps - 2)
        report.update(step_s=round(step_s, 3), tokens_per_s=round(micro_batch * seq / step_s))
    except (RuntimeError, MemoryError) as e:  # torch.OutOfMemoryError is a RuntimeError
        if not out_of_memory(e):
            raise
        report.update(status="OOM", error=str(e).strip().splitlines()[0][:300])
    report.update(peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2),
                  peak_reserved_gib=round(torch.cuda.max_memory_reserved() / 2**30, 2),
                  rss_gib=proc_gib("VmRSS"), rss_peak_gib=proc_gib("VmHWM"),
                  state_host_gib=opt and round(state_bytes(opt) / 2**30, 2))
    return report


if __name__ == "__main__":
    args = parse_args()
    with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed logs to stdout: the JSON line is stdout's one line
        result = main(args.peer, args.shape, args.micro_batch, args.seq, args.steps, args.loss)
    print(json.dumps(result), flush=True)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
