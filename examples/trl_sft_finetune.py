#!/usr/bin/env python3
"""Supervised fine-tuning with TRL's SFTTrainer, LoRA and optstate (``optim="optstate_adamw_4bit"``).

    PYTHONPATH=.:integrations python examples/trl_sft_finetune.py
    PYTHONPATH=.:integrations python examples/trl_sft_finetune.py --optim optstate_adamw_8bit --steps 60

SFTTrainer takes the optstate names like any ``optim`` once ``optstate_hf`` is imported (it builds
its optimizer through the Trainer's). Everything is local and runs on CPU in seconds: the tiny
Llama, tokenizer and text of examples/peft_lora_finetune.py (stand-ins for ``from_pretrained``
and a real data set), a ``datasets.Dataset`` with a ``text`` column, and a LoRA config that
SFTTrainer applies itself.
"""
from __future__ import annotations

import argparse
import importlib.util
import tempfile
from pathlib import Path

import torch
from datasets import Dataset
from peft import LoraConfig
from transformers.utils import logging as hf_logging
from trl import SFTConfig, SFTTrainer

import optstate_hf  # registers optim="optstate_adamw", "optstate_adamw_8bit", "_4bit", "_offload"


def _lora_example():
    """The tokenizer, text and model builders of the PEFT example beside this file."""
    path = Path(__file__).resolve().with_name("peft_lora_finetune.py")
    spec = importlib.util.spec_from_file_location("peft_lora_finetune", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--optim", default="optstate_adamw_4bit", choices=sorted(optstate_hf.OPTIM_NAMES))
    parser.add_argument("--optim-args", default="min_int8_elements=0")
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    hf_logging.set_verbosity_error()

    lora = _lora_example()
    tok = lora.build_tokenizer()
    model = lora.build_model(tok)
    with tempfile.TemporaryDirectory() as out:
        config = SFTConfig(output_dir=out, use_cpu=True, optim=args.optim, optim_args=args.optim_args,
                           max_steps=args.steps, per_device_train_batch_size=16, learning_rate=5e-3,
                           lr_scheduler_type="cosine", logging_steps=max(1, args.steps // 5), save_strategy="no",
                           report_to=[], disable_tqdm=True, seed=0, dataset_text_field="text")
        trainer = SFTTrainer(model=model, args=config, train_dataset=Dataset.from_dict({"text": lora.build_texts()}),
                             processing_class=tok,
                             peft_config=LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, task_type="CAUSAL_LM",
                                                    target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
                             callbacks=[optstate_hf.OptStateCallback()])
        trainer.train()

    report = optstate_hf.find_virtual_optimizer(trainer.optimizer).memory_report()
    n_adapter = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    losses = [(h["step"], h["loss"]) for h in trainer.state.log_history if "loss" in h]
    print(f"\nSFT with LoRA: {n_adapter:,} trainable parameters; {args.optim}")
    print("loss by step: " + ", ".join(f"{s}: {loss:.3f}" for s, loss in losses))
    print(f"optimizer state covers {report['n_params']:,} parameters (the adapters): {report['state_bytes']:,} bytes, "
          f"{report['bits_per_param']:.1f} bits/param, by codec {report['by_codec']} "
          f"(fp32 AdamW: {8 * n_adapter:,} bytes)")
    return {"report": report, "n_adapter": n_adapter, "losses": [loss for _, loss in losses]}


if __name__ == "__main__":
    main()
