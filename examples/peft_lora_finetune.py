#!/usr/bin/env python3
"""LoRA fine-tuning with PEFT, the HF Trainer and optstate: the optimizer holds state for the adapters only.

    PYTHONPATH=.:integrations python examples/peft_lora_finetune.py
    PYTHONPATH=.:integrations python examples/peft_lora_finetune.py --optim optstate_adamw_4bit --steps 60

Everything is local and runs on CPU in seconds: a small Llama built from a config stands in for
the pretrained model you would load with ``from_pretrained``, a word-level tokenizer is built in
memory, and the training text is generated. Only the LoRA matrices train; the script prints
the loss and what ``memory_report()`` says the optimizer holds.
"""
from __future__ import annotations

import argparse
import tempfile

import torch
from peft import LoraConfig, get_peft_model
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (DataCollatorForLanguageModeling, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast,
                          PrinterCallback, Trainer, TrainingArguments)
from transformers.utils import logging as hf_logging

import optstate_hf  # registers optim="optstate_adamw", "optstate_adamw_8bit", "_4bit", "_offload"

WORDS = "zero one two three four five six seven eight nine ten eleven twelve".split()


def build_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {w: i for i, w in enumerate(["<pad>", "<unk>", "<s>", "</s>", "count", "from", ":"] + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")


def build_texts(n: int = 256, seed: int = 0) -> list:
    g = torch.Generator().manual_seed(seed)
    texts = []
    for _ in range(n):
        start, length = int(torch.randint(0, 8, (1,), generator=g)), int(torch.randint(3, 6, (1,), generator=g))
        texts.append(f"count from {WORDS[start]} : " + " ".join(WORDS[start:start + length]))
    return texts


def build_model(tok, seed: int = 0) -> LlamaForCausalLM:
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                      pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--optim", default="optstate_adamw_8bit", choices=sorted(optstate_hf.OPTIM_NAMES))
    parser.add_argument("--optim-args", default="min_int8_elements=0",
                        help="optstate optim_args; LoRA matrices are small, so let int8 apply to all of them")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rank", type=int, default=8)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    hf_logging.set_verbosity_error()

    tok = build_tokenizer()
    model = get_peft_model(build_model(tok), LoraConfig(r=args.rank, lora_alpha=2 * args.rank, lora_dropout=0.0,
                                                        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                                                        task_type="CAUSAL_LM"))
    rows = [{"input_ids": ids} for ids in tok(build_texts())["input_ids"]]
    with tempfile.TemporaryDirectory() as out:
        training = TrainingArguments(output_dir=out, use_cpu=True, optim=args.optim, optim_args=args.optim_args,
                                     max_steps=args.steps, per_device_train_batch_size=16, learning_rate=5e-3,
                                     lr_scheduler_type="cosine", logging_steps=max(1, args.steps // 5),
                                     save_strategy="no", report_to=[], disable_tqdm=True, seed=0)
        trainer = Trainer(model=model, args=training, train_dataset=rows,
                          data_collator=DataCollatorForLanguageModeling(tok, mlm=False),
                          callbacks=[optstate_hf.OptStateCallback()])
        trainer.remove_callback(PrinterCallback)
        trainer.train()

    report = optstate_hf.find_virtual_optimizer(trainer.optimizer).memory_report()
    n_total = sum(p.numel() for p in model.parameters())
    n_adapter = sum(p.numel() for p in model.parameters() if p.requires_grad)
    losses = [(h["step"], h["loss"]) for h in trainer.state.log_history if "loss" in h]
    print(f"\nmodel: {n_total:,} parameters, {n_adapter:,} in LoRA adapters (rank {args.rank}); {args.optim}")
    print("loss by step: " + ", ".join(f"{s}: {loss:.3f}" for s, loss in losses))
    print(f"optimizer state covers {report['n_params']:,} parameters (the adapters): {report['state_bytes']:,} bytes, "
          f"{report['bits_per_param']:.1f} bits/param, by codec {report['by_codec']} "
          f"(fp32 AdamW: {8 * n_adapter:,} bytes)")
    return {"report": report, "n_adapter": n_adapter, "losses": [loss for _, loss in losses]}


if __name__ == "__main__":
    main()
