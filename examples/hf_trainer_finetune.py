#!/usr/bin/env python3
"""Fine-tune a tiny causal LM with the HF Trainer and optstate, and compare with adamw_torch.

    PYTHONPATH=.:integrations python examples/hf_trainer_finetune.py
    PYTHONPATH=.:integrations python examples/hf_trainer_finetune.py --optim optstate_adamw_4bit \
        --optim-args "warmup_steps=10,adaptive=true"

Everything is local (a model built from a config, an in-memory dataset) and runs on CPU in
well under a minute. It trains twice, with ``adamw_torch`` and with the optstate optimizer,
and prints the optimizer state each one holds between steps.
"""
from __future__ import annotations

import argparse
import tempfile
import time

import torch

import optstate_hf  # registers optim="optstate_adamw", "optstate_adamw_8bit", "_4bit", "_offload"
from transformers import LlamaConfig, LlamaForCausalLM, PrinterCallback, Trainer, TrainingArguments
from transformers.utils import logging as hf_logging

VOCAB, SEQ = 256, 32


def build_model(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=SEQ,
                      bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return LlamaForCausalLM(cfg)


def build_dataset(n: int = 512, seed: int = 0) -> list:
    """Arithmetic sequences mod VOCAB with 10% noise: easy to learn, nothing to download."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        start, stride = torch.randint(0, VOCAB, (2,), generator=g).tolist()
        ids = (start + (stride % 7 + 1) * torch.arange(SEQ)) % VOCAB
        noise = torch.rand(SEQ, generator=g) < 0.1
        ids = torch.where(noise, torch.randint(0, VOCAB, (SEQ,), generator=g), ids)
        rows.append({"input_ids": ids, "labels": ids.clone()})
    return rows


def state_bytes(optimizer) -> int:
    """Bytes held between steps by a plain torch optimizer (tensors other than scalar steps)."""
    return sum(v.numel() * v.element_size() for st in optimizer.state.values() for v in st.values()
               if isinstance(v, torch.Tensor) and v.dim() > 0)


def train(optim: str, optim_args, steps: int, out_dir: str):
    args = TrainingArguments(output_dir=out_dir, use_cpu=True, optim=optim, optim_args=optim_args, max_steps=steps,
                             per_device_train_batch_size=16, learning_rate=2e-3, weight_decay=0.01,
                             lr_scheduler_type="cosine", warmup_steps=max(1, steps // 10),
                             logging_steps=max(1, steps // 5), save_strategy="no", report_to=[],
                             disable_tqdm=True, seed=0)
    callbacks = [optstate_hf.OptStateCallback()] if optim.startswith("optstate") else []
    trainer = Trainer(model=build_model(), args=args, train_dataset=build_dataset(), callbacks=callbacks)
    trainer.remove_callback(PrinterCallback)  # this script prints its own table
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return trainer, logs, seconds


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--optim", default="optstate_adamw", choices=sorted(optstate_hf.OPTIM_NAMES))
    parser.add_argument("--optim-args", default="min_int8_elements=1024",
                        help="optstate optim_args, e.g. 'state=int4,warmup_steps=10'")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (default 1: fastest for a model this small, and immune to "
                             "oversubscribed CPUs); 0 keeps torch's default")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    hf_logging.set_verbosity_error()

    with tempfile.TemporaryDirectory() as out:
        ref, ref_logs, ref_s = train("adamw_torch", None, args.steps, out)
        ours, our_logs, our_s = train(args.optim, args.optim_args, args.steps, out)

    opt = optstate_hf.find_virtual_optimizer(ours.optimizer)
    report = opt.memory_report()
    n_params = report["n_params"]
    ref_bytes = state_bytes(ref.optimizer.optimizer)
    our_bytes = report["state_bytes"]
    print(f"\nmodel: {n_params:,} parameters; {args.steps} steps; {args.optim} optim_args={args.optim_args!r}")
    print(f"{'step':>6} {'adamw_torch loss':>17} {args.optim + ' loss':>24}")
    for a, b in zip(ref_logs, our_logs):
        print(f"{a['step']:>6} {a['loss']:>17.4f} {b['loss']:>24.4f}")
    print(f"\n{'':<22}{'state MiB':>10}{'bits/param':>12}{'train s':>9}")
    print(f"{'adamw_torch':<22}{ref_bytes / 2**20:>10.3f}{8 * ref_bytes / n_params:>12.1f}{ref_s:>9.1f}")
    print(f"{args.optim:<22}{our_bytes / 2**20:>10.3f}{report['bits_per_param']:>12.1f}{our_s:>9.1f}"
          f"   (device {report['device_bytes'] / 2**20:.3f} MiB, host {report['host_bytes'] / 2**20:.3f} MiB)")
    print(f"\noptimizer memory saved: {(ref_bytes - our_bytes) / 2**20:.3f} MiB "
          f"({100 * (1 - our_bytes / ref_bytes):.1f}% less than adamw_torch); by codec: {report['by_codec']}")


if __name__ == "__main__":
    main()
