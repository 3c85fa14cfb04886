"""Tiny Llama, word-level tokenizer and text rows for the PEFT / TRL tests (CPU, built offline)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven"]
SPECIAL = ["<pad>", "<unk>", "<s>", "</s>"]


def text_rows(n: int = 48, seed: int = 0) -> list:
    """Counting sentences ("count from three : three four five six seven"), easy to learn."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        start = int(torch.randint(0, 6, (1,), generator=g))
        length = int(torch.randint(3, 6, (1,), generator=g))
        rows.append("count from " + WORDS[start] + " : " + " ".join(WORDS[start:start + length]))
    return rows


def tiny_tokenizer():
    """A word-level ``PreTrainedTokenizerFast`` over the rows' words (no files, no hub)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(SPECIAL + WORDS + ["count", "from", ":"])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")


def tiny_llama(tokenizer, seed: int = 0):
    """A 2-layer Llama from a config; its attention and MLP projections are what LoRA adapts."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                      pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                      eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg)


def lora_config(**overrides):
    from peft import LoraConfig

    kwargs = dict(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    kwargs.update(overrides)
    return LoraConfig(**kwargs)


def trainable(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def assert_state_dicts_equal(a, b, path="state"):
    """Bit-identical nested optimizer state dicts (tensors by torch.equal, the rest by ==)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{path}: {sorted(a)} != {sorted(b)}"
        for key in a:
            assert_state_dicts_equal(a[key], b[key], f"{path}.{key}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_state_dicts_equal(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"
