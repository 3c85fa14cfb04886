"""One training-step trial (build a Llama-shaped model, step an optimizer, measure time and memory),
run in a fresh subprocess so that an OOM or a fragmented allocator never touches the next trial.

``python -m optstate_core.apps.trial '<json spec>'`` prints one line ``OPTSTATE_TRIAL {json result}``;
:func:`run_in_subprocess` starts it with a timeout and reads that line. Result ``status``: ``ok``,
``oom``, ``timeout``, ``error`` or ``unavailable``.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import torch

log = logging.getLogger("optstate")

MARK = "OPTSTATE_TRIAL "
NOT_FIT = ("oom", "timeout")


@dataclass
class TrialSpec:
    """What one trial runs: the model shape (LlamaShape fields), the optimizer name, the batch."""
    shape: dict
    optimizer: str
    batch: int = 4
    seq: int = 512
    checkpointing: bool = True
    device: str = "cuda"
    steps: int = 3
    warmup: int = 1
    memory_cap: Optional[int] = None  # bytes the process may allocate on the GPU (set_per_process_memory_fraction)
    accumulate: int = 1  # micro-batches of ``batch`` x ``seq`` per optimizer step


def _is_oom(e: BaseException) -> bool:
    text = str(e).lower()
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in text or "cudaerrormemoryallocation" in text


def run_trial(spec: TrialSpec) -> dict:
    """Run the trial in this process; returns the result dict (never raises for OOM)."""
    from . import contenders
    from .llama import LlamaShape, build_model

    shape = LlamaShape(**spec.shape)
    contender = contenders.parse(spec.optimizer)
    out = {"status": "ok", "params": shape.params, "optimizer": spec.optimizer, "shape": spec.shape}
    missing = contenders.unavailable(contender)
    if missing:
        return {**out, "status": "unavailable", "error": missing}
    device = torch.device(spec.device)
    cuda = device.type == "cuda"
    torch.manual_seed(0)  # the same tokens for every optimizer
    if cuda:
        out["gpu_total_bytes"] = total = torch.cuda.get_device_properties(device).total_memory
        if spec.memory_cap is not None:  # allocations past the cap raise OOM, as on a smaller card
            index = device.index if device.index is not None else torch.cuda.current_device()
            torch.cuda.set_per_process_memory_fraction(min(1.0, spec.memory_cap / total), index)
    try:
        t0 = time.perf_counter()
        model = build_model(shape, device, contender.weights, spec.checkpointing)
        params = [p for p in model.parameters() if p.requires_grad]
        out["weight_bytes"] = sum(p.numel() * p.element_size() for p in params)
        opt = contenders.build(contender, params, model)
        undo = contenders.free_gradients_in_hooks(params) if opt is None else None
        tokens = torch.randint(0, shape.vocab, (spec.batch, spec.seq), device=device)
        out["build_s"] = time.perf_counter() - t0
        times = []
        out["steps_allocated_bytes"] = []  # CUDA: (allocated at the step's start, the running peak at its end)
        for i in range(spec.warmup + spec.steps):
            if cuda:
                torch.cuda.synchronize(device)
                if i == spec.warmup:
                    out["peak_first_bytes"] = torch.cuda.max_memory_allocated(device)
                    torch.cuda.reset_peak_memory_stats(device)
                start = torch.cuda.memory_allocated(device)
            t = time.perf_counter()
            for k in range(spec.accumulate):
                if hasattr(opt, "set_step_boundary"):  # release on the window's last micro-batch only
                    opt.set_step_boundary(k == spec.accumulate - 1)
                out["failed_in"] = f"step {i}, forward of micro-batch {k}"  # where an OOM struck, if one does
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=contender.autocast):
                    loss = model(input_ids=tokens, labels=tokens).loss
                out["failed_in"] = f"step {i}, backward of micro-batch {k}"
                loss.backward()
            out["failed_in"] = f"step {i}, optimizer step"
            if opt is not None:
                opt.step()
                opt.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize(device)
                out["steps_allocated_bytes"].append((start, torch.cuda.max_memory_allocated(device)))
            if i >= spec.warmup:
                times.append(time.perf_counter() - t)
        del out["failed_in"]
        out["loss"] = float(loss.detach())
        out["step_s"] = statistics.median(times)
        out["tokens_per_s"] = spec.accumulate * spec.batch * spec.seq / out["step_s"]
        if cuda:
            out["peak_step_bytes"] = torch.cuda.max_memory_allocated(device)
            out["peak_bytes"] = max(out["peak_step_bytes"], out["peak_first_bytes"])
            out["held_bytes"] = torch.cuda.memory_allocated(device)  # weights + state between steps
        if hasattr(opt, "memory_report"):
            report = opt.memory_report()
            out["optimizer_device_bytes"], out["optimizer_host_bytes"] = report["device_bytes"], report["host_bytes"]
        if hasattr(opt, "close"):
            opt.close()
        if undo is not None:
            undo()
    except Exception as e:  # OOM is a result; anything else is reported as an error
        out.update(status="oom" if _is_oom(e) else "error", error=f"{type(e).__name__}: {str(e)[:300]}")
    return out


def run_in_subprocess(spec: TrialSpec, timeout: float) -> dict:
    """Run the trial in a fresh interpreter (own process group, killed on timeout)."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "") if env.get("PYTHONPATH") else root
    env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    cmd = [sys.executable, "-m", "optstate_core.apps.trial", json.dumps(asdict(spec))]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    base = {"params": None, "optimizer": spec.optimizer, "shape": spec.shape}
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return {**base, "status": "timeout", "error": f"no result within {timeout:.0f} s"}
    for line in reversed(stdout.splitlines()):
        if line.startswith(MARK):
            return json.loads(line[len(MARK):])
    tail = " | ".join(stderr.strip().splitlines()[-3:])[:300]
    if proc.returncode == -signal.SIGKILL:  # not ours (timeouts return above): the kernel's OOM killer
        return {**base, "status": "oom", "error": f"killed by SIGKILL (host memory exhausted?) {tail}"}
    status = "oom" if "out of memory" in stderr.lower() else "error"
    return {**base, "status": status, "error": f"exit {proc.returncode}: {tail}"}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.WARNING)
    result = run_trial(TrialSpec(**json.loads(argv[0])))
    print(MARK + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
