"""Parameter shapes for ``optstate plan``: from a Hugging Face ``config.json`` (Llama / Mistral /
Qwen2/3 / GPT-2 families) or approximated from a parameter count."""
from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import List, Tuple

log = logging.getLogger("optstate.plan")

Shape = Tuple[int, ...]
NamedShapes = List[Tuple[str, Shape]]
APPROX_ROWS = 4096
COUNT_SUFFIXES = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}


def parse_count(text: str) -> int:
    """``"7B"`` -> 7_000_000_000 (suffixes K, M, B/G, T; decimals allowed: ``"1.5B"``)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]?)\s*", str(text))
    if not m or m.group(2).lower() not in COUNT_SUFFIXES:
        raise ValueError(f"--params must be a count such as 125M, 7B or 6738415616, got {text!r}")
    n = int(round(float(m.group(1)) * COUNT_SUFFIXES[m.group(2).lower()]))
    if n < 1:
        raise ValueError(f"--params must be at least 1, got {text!r}")
    return n


def approximate_shapes(n_params: int) -> NamedShapes:
    """``n_params`` as ``[4096, 4096]`` matrices, a ``[4096, k]`` one and a 1-D remainder.

    Large models are almost all matrices of about this size (a 7B-8B model's layer weights), so
    the block codecs' per-block scales come out right and gradient release frees what it would
    (a gradient at a time, not the whole model); norms and biases (well under 0.1% of a large
    model) stay uncompressed and are ignored. Give ``--config`` for exact numbers."""
    block = APPROX_ROWS * APPROX_ROWS
    full, rest = divmod(n_params, block)
    shapes: NamedShapes = [(f"params.{i}", (APPROX_ROWS, APPROX_ROWS)) for i in range(full)]
    cols, rest = divmod(rest, APPROX_ROWS)
    if cols:
        shapes.append((f"params.{full}", (APPROX_ROWS, cols)))
    if rest:
        shapes.append(("params.rest", (rest,)))
    return shapes


# -- shapes from a Hugging Face config ------------------------------------------------------
def _get(config: dict, *keys, default=None):
    for k in keys:
        if config.get(k) is not None:
            return config[k]
    if default is not None:
        return default
    raise ValueError(f"--config: missing {' / '.join(keys)}")


def config_shapes(config: dict) -> NamedShapes:
    """Parameter names and shapes of a causal LM described by a Hugging Face ``config.json``.

    Supported: GPT-2 (``model_type`` gpt2) and the Llama family (llama, mistral, qwen2, qwen3 and
    any config with ``hidden_size`` / ``intermediate_size`` / ``num_hidden_layers`` /
    ``num_attention_heads``; grouped-query attention through ``num_key_value_heads``).
    """
    if not isinstance(config, dict):
        raise ValueError("--config must hold a JSON object")
    if "text_config" in config and "hidden_size" not in config:  # multimodal wrapper: its language model
        config = config["text_config"]
    model_type = config.get("model_type", "")
    if model_type == "gpt2" or "n_embd" in config:
        return _gpt2_shapes(config)
    if model_type not in ("llama", "mistral", "qwen2", "qwen3", ""):
        log.warning("model_type %r: computing shapes as for a Llama-style model", model_type)
    return _llama_shapes(config, model_type)


def attention_shape(c: dict) -> Tuple[int, int, int]:
    """``(heads, kv_heads, head_dim)`` of a Llama-family ``config.json`` (its language model's)."""
    if "text_config" in c and "hidden_size" not in c:
        c = c["text_config"]
    heads = _get(c, "num_attention_heads")
    return heads, _get(c, "num_key_value_heads", default=heads), c.get("head_dim") or _get(c, "hidden_size") // heads


def _llama_shapes(c: dict, model_type: str) -> NamedShapes:
    vocab = _get(c, "vocab_size")
    hidden = _get(c, "hidden_size")
    inter = _get(c, "intermediate_size")
    layers = _get(c, "num_hidden_layers")
    heads, kv, head_dim = attention_shape(c)
    qkv_bias = bool(c.get("attention_bias", False)) or model_type == "qwen2"
    o_bias = bool(c.get("attention_bias", False))
    mlp_bias = bool(c.get("mlp_bias", False))
    tied = bool(c.get("tie_word_embeddings", False))
    shapes: NamedShapes = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        attn = [("q_proj", heads * head_dim, hidden, qkv_bias), ("k_proj", kv * head_dim, hidden, qkv_bias),
                ("v_proj", kv * head_dim, hidden, qkv_bias), ("o_proj", hidden, heads * head_dim, o_bias)]
        for name, out_f, in_f, bias in attn:
            shapes.append((f"{p}self_attn.{name}.weight", (out_f, in_f)))
            if bias:
                shapes.append((f"{p}self_attn.{name}.bias", (out_f,)))
        if model_type == "qwen3":
            shapes += [(f"{p}self_attn.q_norm.weight", (head_dim,)), (f"{p}self_attn.k_norm.weight", (head_dim,))]
        for name, out_f, in_f in (("gate_proj", inter, hidden), ("up_proj", inter, hidden),
                                  ("down_proj", hidden, inter)):
            shapes.append((f"{p}mlp.{name}.weight", (out_f, in_f)))
            if mlp_bias:
                shapes.append((f"{p}mlp.{name}.bias", (out_f,)))
        shapes += [(f"{p}input_layernorm.weight", (hidden,)), (f"{p}post_attention_layernorm.weight", (hidden,))]
    shapes.append(("model.norm.weight", (hidden,)))
    if not tied:
        shapes.append(("lm_head.weight", (vocab, hidden)))
    return shapes


def _gpt2_shapes(c: dict) -> NamedShapes:
    vocab = _get(c, "vocab_size")
    d = _get(c, "n_embd", "hidden_size")
    layers = _get(c, "n_layer", "num_hidden_layers")
    positions = _get(c, "n_positions", "max_position_embeddings")
    inner = c.get("n_inner") or 4 * d
    shapes: NamedShapes = [("transformer.wte.weight", (vocab, d)), ("transformer.wpe.weight", (positions, d))]
    for i in range(layers):
        p = f"transformer.h.{i}."
        # GPT-2's Conv1D stores weights as [in_features, out_features]
        for name, shape in (("ln_1.weight", (d,)), ("ln_1.bias", (d,)),
                            ("attn.c_attn.weight", (d, 3 * d)), ("attn.c_attn.bias", (3 * d,)),
                            ("attn.c_proj.weight", (d, d)), ("attn.c_proj.bias", (d,)),
                            ("ln_2.weight", (d,)), ("ln_2.bias", (d,)),
                            ("mlp.c_fc.weight", (d, inner)), ("mlp.c_fc.bias", (inner,)),
                            ("mlp.c_proj.weight", (inner, d)), ("mlp.c_proj.bias", (d,))):
            shapes.append((p + name, shape))
    shapes += [("transformer.ln_f.weight", (d,)), ("transformer.ln_f.bias", (d,))]
    if not c.get("tie_word_embeddings", True):
        shapes.append(("lm_head.weight", (vocab, d)))
    return shapes


def load_config(path: str) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except OSError as e:
        raise ValueError(f"--config: cannot read {path!r}: {e}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"--config: {path!r} is not valid JSON: {e}") from None


#: the share of one recomputed layer's activations alive at the peak of a step with the fused loss:
#: fit to Llama-3-8B at 1x2048 and 2x2048 on one H100 (18.43, 19.02 GiB, bf16w-4bit-lean-offload),
#: Llama-3-8B and -70B at 1x4096 per rank on 4 H100s under FSDP2 (10.99, 52.22 GiB)
FUSED_LOSS_RECOMPUTED = 0.15


def checkpointed_activation_bytes(config: dict, batch: int, seq: int, fused_loss: bool = False) -> int:
    """An estimate of a Llama-family causal LM's activation memory with activation checkpointing
    (one checkpoint per decoder layer), bf16 compute: every layer's saved input (``b*s*h`` bf16),
    one layer recomputed in backward (``b*s*(10h + 8i)`` bf16 values: attention and SwiGLU
    intermediates and their gradients) and the logits (bf16, their fp32 copy for the loss and
    its fp32 gradient: ``10*b*s*V`` bytes). The constants 10 and 8 fit one measurement: a
    Llama-3-8B shape at 1x2048 took 3.56 GiB (docs/benchmarks-journal.md section 23); measure your own run
    (``optstate bench --peak-bytes``) before relying on it. ``fused_loss``: the loss over
    vocabulary slices (:mod:`optstate_core.apps.chunked_loss`) instead of whole logits, its
    :func:`~optstate_core.apps.chunked_loss.chunked_loss_bytes` in place of the ``10*b*s*V`` term, and
    only :data:`FUSED_LOSS_RECOMPUTED` of the recomputed layer's term: without the logits the peak
    comes where little of it is alive (fit to four H100 peaks, docs/benchmarks-journal.md section 27)."""
    if "text_config" in config and "hidden_size" not in config:
        config = config["text_config"]
    try:
        h, i = int(config["hidden_size"]), int(config["intermediate_size"])
        layers, vocab = int(config["num_hidden_layers"]), int(config["vocab_size"])
    except (KeyError, TypeError, ValueError):
        raise ValueError("--batch: the activation estimate needs a Llama-family --config (hidden_size, "
                         "intermediate_size, num_hidden_layers, vocab_size); give --activations instead") from None
    tokens = batch * seq
    saved, recomputed = tokens * layers * h * 2, tokens * (10 * h + 8 * i) * 2
    if fused_loss:
        from .chunked_loss import chunked_loss_bytes
        return saved + int(FUSED_LOSS_RECOMPUTED * recomputed) + chunked_loss_bytes(tokens, h, vocab)
    return saved + recomputed + tokens * 10 * vocab


def parse_batch(text: str) -> Tuple[int, int]:
    """``"4x2048"`` -> (4, 2048): sequences per GPU and tokens per sequence."""
    m = re.fullmatch(r"\s*(\d+)\s*[xX*]\s*(\d+)\s*", str(text))
    if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
        raise ValueError(f"--batch must be sequences x tokens per GPU, such as 1x2048, got {text!r}")
    return int(m.group(1)), int(m.group(2))
