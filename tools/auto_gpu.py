"""Does ``optim="optstate_adamw_auto"`` fit where it says, with each loss path? One case per call.

Usage (from a checkout, on a GPU; liger-kernel installed for ``liger``)::

    PYTHONPATH=.:integrations python tools/auto_gpu.py LOSS CAP_GB MICRO_BATCH [SHAPE [STEPS]]
    for c in "liger 24 1" "chunked 24 1" "plain 24 1" "liger 24 4"; do python tools/auto_gpu.py $c; done

It builds a Llama shape (default ``8b``, random weights, bf16, activation checkpointing), caps this
process's GPU memory at CAP_GB (1e9 bytes, ``set_per_process_memory_fraction``), and trains STEPS (4) steps of
MICRO_BATCH x 2048 tokens through the HF Trainer with ``optim="optstate_adamw_auto"``. LOSS is
``plain`` (the model's own loss: logits), ``chunked`` (``use_chunked_loss``) or ``liger``
(``use_liger_kernel=True``). It prints one JSON line: auto's log line (the choice and its expected
peak), the measured peak (``max_memory_allocated``), OOM or not, the losses, and the mean seconds per step from the third
step to the last (``step_s``: wall clock, the device synchronised at the window's two ends, as
examples/finetune_8b_24gb.py times its window) with the tokens/s it gives.
"""
import json
import logging
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True,pinned_use_cuda_host_register:True,"
                                                 "pinned_num_register_threads:8")
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "integrations")]
SEQ = 2048


def main(loss: str, cap_gb: float, micro_batch: int, shape: str = "8b", steps: int = 4) -> dict:
    import optstate_hf  # noqa: F401  (registers the names)
    import optstate_core as oc
    from optstate_core.apps.chunked_loss import use_chunked_loss
    from optstate_core.apps.llama import NAMED_SHAPES, build_model
    from transformers import Trainer, TrainerCallback, TrainingArguments

    window = {}

    class WindowTimer(TrainerCallback):
        """Wall clock over steps 3..last, synchronised at the two ends only."""

        def on_step_begin(self, a, state, control, **kw):
            if state.global_step == 2:
                torch.cuda.synchronize()
                window["t0"] = time.perf_counter()

        def on_step_end(self, a, state, control, **kw):
            if state.global_step == steps and "t0" in window:
                torch.cuda.synchronize()
                window["step_s"] = (time.perf_counter() - window["t0"]) / (steps - 2)

    torch.cuda.set_per_process_memory_fraction(cap_gb * 1e9 / torch.cuda.get_device_properties(0).total_memory)
    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("optstate.auto").addHandler(handler)
    logging.getLogger("optstate.auto").setLevel(logging.INFO)
    model = build_model(NAMED_SHAPES[shape], "cuda", torch.bfloat16, checkpointing=True)
    model.config.max_position_embeddings = SEQ  # the sequence length auto plans for
    if loss == "chunked":
        use_chunked_loss(model)
    ids = torch.randint(0, 2048, (steps * micro_batch, SEQ), generator=torch.Generator().manual_seed(0))
    args = TrainingArguments(output_dir="/tmp/auto_gpu", optim="optstate_adamw_auto", max_steps=steps,
                             per_device_train_batch_size=micro_batch, learning_rate=1e-5, max_grad_norm=1.0,
                             lr_scheduler_type="constant", logging_steps=1, save_strategy="no", report_to=[],
                             disable_tqdm=True, use_liger_kernel=loss == "liger", dataloader_num_workers=0)
    trainer = Trainer(model=model, args=args, train_dataset=[{"input_ids": r, "labels": r.clone()} for r in ids],
                      callbacks=[WindowTimer()])
    torch.cuda.reset_peak_memory_stats()
    started, status = time.perf_counter(), "ok"
    try:
        trainer.train()
    except torch.OutOfMemoryError:
        status = "OOM"
    opt = oc.unwrap(trainer.optimizer)
    return {"case": [loss, cap_gb, micro_batch, shape], "status": status, "auto": lines,
            "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2), "s": round(time.perf_counter() - started, 1),
            "release": getattr(opt, "release_gradients", None), "step_s": window.get("step_s"),
            "tokens_per_s": micro_batch * SEQ / window["step_s"] if window.get("step_s") else None,
            "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h]}


if __name__ == "__main__":
    if len(sys.argv) not in (4, 5, 6) or sys.argv[1] not in ("plain", "chunked", "liger"):
        sys.exit(__doc__)
    extra = sys.argv[4:5] + [int(a) for a in sys.argv[5:6]]
    print(json.dumps(main(sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), *extra)), flush=True)
