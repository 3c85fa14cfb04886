"""Llama-shaped causal LMs for the capacity and peak-memory benchmarks: shapes, exact parameter
counts, and construction on the meta device materialized straight on the target device."""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True)
class LlamaShape:
    """The dimensions of a Llama-shaped model (untied embeddings, gated MLP, grouped-query attention)."""
    hidden: int
    layers: int
    ffn: int
    heads: int
    kv_heads: int
    vocab: int

    @classmethod
    def grown(cls, hidden: int, layers: int, vocab: int) -> "LlamaShape":
        """Llama-3 proportions at this width: head dim 128, ffn 3.5 x hidden, kv heads heads/4 (at most 8)."""
        step = 256 if hidden >= 1024 else 16
        ffn = max(step, int(round(3.5 * hidden / step)) * step)
        heads = max(1, hidden // 128)
        return cls(hidden, layers, ffn, heads, max(1, min(8, heads // 4)), vocab)

    @property
    def params(self) -> int:
        """Exact parameter count of the model :func:`build_model` builds."""
        h, kv_dim = self.hidden, self.kv_heads * (self.hidden // self.heads)
        per_layer = 2 * h * h + 2 * h * kv_dim + 3 * h * self.ffn + 2 * h
        return 2 * self.vocab * h + self.layers * per_layer + h

    def describe(self) -> str:
        return (f"hidden {self.hidden}, {self.layers} layers, ffn {self.ffn}, {self.heads}/{self.kv_heads} heads, "
                f"vocab {self.vocab}")

    def to_dict(self) -> dict:
        return asdict(self)

    def hf_config(self) -> dict:
        """The Hugging Face ``config.json`` fields of this shape (what ``optstate plan --config`` reads)."""
        return {"model_type": "llama", "hidden_size": self.hidden, "intermediate_size": self.ffn,
                "num_hidden_layers": self.layers, "num_attention_heads": self.heads,
                "num_key_value_heads": self.kv_heads, "vocab_size": self.vocab, "tie_word_embeddings": False}


#: the configurations the peak-memory benchmark (issue 14) names
NAMED_SHAPES = {
    "0.95b": LlamaShape(hidden=2048, layers=16, ffn=5632, heads=16, kv_heads=16, vocab=32000),  # e2e.py's
    "3b": LlamaShape(hidden=3072, layers=28, ffn=8192, heads=24, kv_heads=8, vocab=128256),  # Llama-3.2-3B's, untied
    "8b": LlamaShape(hidden=4096, layers=32, ffn=14336, heads=32, kv_heads=8, vocab=128256),  # Llama-3-8B's
    "70b": LlamaShape(hidden=8192, layers=80, ffn=28672, heads=64, kv_heads=8, vocab=128256),  # Llama-3-70B's
    "405b": LlamaShape(hidden=16384, layers=126, ffn=53248, heads=128, kv_heads=8, vocab=128256),  # Llama-3.1-405B's
    "tiny": LlamaShape(hidden=64, layers=2, ffn=128, heads=2, kv_heads=1, vocab=256),
}


def build_model(shape: LlamaShape, device, dtype: torch.dtype = torch.float32, checkpointing: bool = False,
                seed: int = 0, shard=None, stream: bool = False):
    """A ``transformers`` LlamaForCausalLM of ``shape``, built on the meta device and materialized
    directly on ``device`` in ``dtype`` (random init N(0, 0.02) for matrices, ones for norms): an
    8B model takes seconds and never exists on the host. ``shard(model)``: called on the meta
    model before it is materialized (FSDP2's ``fully_shard`` of each layer and the root), so each
    rank allocates and initializes only its own shards (a 70B model never exists whole on a rank;
    each rank's shards draw from a stream seeded by ``seed`` and the rank). ``stream``: the decoder
    layers are materialized one at a time and moved to host memory (``offload_weights``) before the
    next, so they never are on ``device`` together (for ``stream_weights``; the same values)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from ..schedule.weight_stream import offload_weights

    config = LlamaConfig(hidden_size=shape.hidden, intermediate_size=shape.ffn, num_hidden_layers=shape.layers,
                         num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
                         vocab_size=shape.vocab, max_position_embeddings=8192, tie_word_embeddings=False,
                         use_cache=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to(dtype)
    if shard is not None:
        shard(model)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            seed = seed * 1_000_003 + torch.distributed.get_rank()
    layers = list(model.model.layers) if stream else []
    if stream:  # all but the streamed layers now; those one at a time below
        for module in outside(model, layers):
            module.to_empty(device=device, recurse=False)
    else:
        model = model.to_empty(device=device)
    names = [name for name, _ in model.named_parameters()]  # (to_empty swaps a meta parameter for a new one)
    layer_of = {name: int(name.split(".")[2]) for name in names if stream and name.startswith("model.layers.")}
    last_of = {i: name for name, i in layer_of.items()}  # each layer's last parameter, in this order
    first_of = {i: name for name, i in reversed(layer_of.items())}
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name in names:  # in the same order, with or without streaming: the same values
            i = layer_of.get(name)
            if i is not None and first_of[i] == name:
                layers[i].to_empty(device=device)
            p = model.get_parameter(name)
            local = p._local_tensor if hasattr(p, "_local_tensor") else p  # a DTensor's own shard
            if p.dim() >= 2:
                local.normal_(0.0, 0.02, generator=gen)
            else:
                local.fill_(1.0)
            if i is not None and last_of[i] == name:
                offload_weights(model, [layers[i]])
    reset_rotary(model, config, device)
    if checkpointing:
        enable_checkpointing(model)
    return model.train()


def outside(model, layers) -> list:
    """The modules of ``model`` that are not (inside) one of ``layers``."""
    inside = {id(m) for layer in layers for m in layer.modules()}
    return [m for m in model.modules() if id(m) not in inside]


def reset_rotary(model, config, device) -> None:
    """Recompute the non-persistent buffers (rotary ``inv_freq``) of a model materialised from meta."""
    with torch.no_grad():
        for name, module in list(model.named_modules()):
            if type(module).__name__.endswith("RotaryEmbedding"):
                parent_name, _, attr = name.rpartition(".")
                parent = model.get_submodule(parent_name) if parent_name else model
                setattr(parent, attr, type(module)(config=config).to(device))


def load_streamed(path: str, device, dtype: torch.dtype = torch.bfloat16, checkpointing: bool = True):
    """A Hugging Face causal LM from a checkpoint directory (``config.json`` and ``*.safetensors``,
    one file or sharded with its index) with its decoder layers in host memory for ``stream_weights``:
    each layer is materialised on ``device``, filled from the files and moved home
    (``offload_weights``) before the next, so the model is never whole on the device or the host;
    the rest (embeddings, norm, lm_head) is loaded on ``device``."""
    import json
    import os

    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    from ..schedule.weight_stream import decoder_layers, offload_weights

    config = AutoConfig.from_pretrained(path)
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = {key: os.path.join(path, name) for key, name in json.load(f)["weight_map"].items()}
    else:
        single = os.path.join(path, "model.safetensors")
        if not os.path.exists(single):
            raise ValueError(f"load_streamed: path {path!r} has no model.safetensors(.index.json)")
        with safe_open(single, "pt") as f:
            files = {key: single for key in f.keys()}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, torch_dtype=dtype)
    layers = decoder_layers(model)
    names = {id(m): name for name, m in model.named_modules()}
    handles = {}

    def fill(module, recurse: bool) -> None:
        module.to_empty(device=device, recurse=recurse)
        prefix = names[id(module)] + "." if names[id(module)] else ""
        for name, tensor in list(module.named_parameters(recurse=recurse)) + list(module.named_buffers(recurse=recurse)):
            key = prefix + name
            if key in files:
                handle = handles.get(files[key]) or handles.setdefault(files[key], safe_open(files[key], "pt"))
                with torch.no_grad():
                    tensor.copy_(handle.get_tensor(key).to(tensor.dtype))

    for module in outside(model, layers):
        fill(module, recurse=False)
    model.tie_weights()  # a tied lm_head has no entry of its own
    for layer in layers:
        fill(layer, recurse=True)
        offload_weights(model, [layer])
    reset_rotary(model, config, device)
    if checkpointing:
        enable_checkpointing(model)
    return model.train()


def enable_checkpointing(model) -> None:
    """Activation checkpointing (non-reentrant) of a Hugging Face model, under either API name."""
    enable = getattr(model, "activation_checkpointing_enable", None)  # transformers >= 5.2x's name
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def shard_each_layer(model, **fsdp_options) -> None:
    """FSDP2's ``fully_shard`` on each decoder layer, then on the whole model (``build_model(shard=...)``)."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer, **fsdp_options)
    fully_shard(model, **fsdp_options)
