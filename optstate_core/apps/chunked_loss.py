"""A causal LM's loss without its logits: linear + cross-entropy over slices of the vocabulary.

The logits of a 128256-word vocabulary are the largest activation of a Llama-3 step (batch 1 x
2048: 0.5 GiB in bf16, then an fp32 copy and its fp32 gradient). :class:`ChunkedLinearCrossEntropy`
never holds more than one vocabulary slice of them: the forward pass keeps each token's
log-sum-exp and target logit, and the backward pass recomputes the slices, turning each into its
rows of the weight's gradient (one matmul per slice, no accumulation across slices) and a term of
the hidden states' gradient (accumulated in fp32). The arithmetic is the plain loss's: logits in
the compute dtype upcast to fp32, their gradient cast back. The price is one more
``tokens x hidden x vocab`` matmul in backward.

:func:`use_chunked_loss` swaps it into a Hugging Face causal LM (``model.model`` then
``model.lm_head``) so the Trainer, Lightning and Accelerate get ``outputs.loss`` as before, and
``outputs.logits`` is None.
"""
from __future__ import annotations

import types
from typing import Optional

import torch

IGNORE_INDEX = -100
SLICE_BYTES = 256 * 2**20  # the fp32 logits of one vocabulary slice and their compute-dtype copy, at most


def vocab_slice(tokens: int, vocab: int, slice_bytes: int = SLICE_BYTES) -> int:
    """Vocabulary rows per slice: ``tokens x slice`` fp32 logits plus their compute-dtype copy
    within ``slice_bytes``, a multiple of 128, at least 128."""
    rows = slice_bytes // (6 * max(tokens, 1))
    return int(min(vocab, max(128, rows // 128 * 128)))


def chunked_loss_bytes(tokens: int, hidden: int, vocab: int, slice_bytes: int = SLICE_BYTES) -> int:
    """Bytes the loss adds at its peak beside the hidden states it reads: one slice of logits
    (fp32 and the compute dtype), the fp32 accumulator of the hidden states' gradient and the
    per-token statistics."""
    return 6 * tokens * vocab_slice(tokens, vocab, slice_bytes) + 4 * tokens * hidden + 16 * tokens


def _compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    kind = hidden.device.type
    if torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return weight.dtype


def _in_slice(safe: torch.Tensor, valid: torch.Tensor, v0: int, rows: int):
    """Which tokens' labels fall in the vocabulary slice ``[v0, v0 + rows)``, and each token's column
    there (clamped, to index without a host synchronisation)."""
    inside = valid & (safe >= v0) & (safe < v0 + rows)
    return inside, (safe - v0).clamp_(0, rows - 1)[:, None]


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """``cross_entropy(hidden @ weight.T, labels)`` over vocabulary slices (see the module doc)."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, divisor, slice_rows):
        dtype = _compute_dtype(hidden, weight)
        with torch.autocast(hidden.device.type, enabled=False):
            h = hidden.to(dtype)
            n, vocab = h.shape[0], weight.shape[0]
            acc = torch.promote_types(dtype, torch.float32)  # the loss's dtype (fp32, fp64 for fp64 models)
            lse = torch.full((n,), float("-inf"), dtype=acc, device=h.device)
            target = torch.zeros(n, dtype=acc, device=h.device)
            valid = labels != IGNORE_INDEX
            safe = torch.where(valid, labels, 0)
            for v0 in range(0, vocab, slice_rows):
                logits = (h @ weight[v0:v0 + slice_rows].to(dtype).T).to(acc)
                lse = torch.logaddexp(lse, torch.logsumexp(logits, dim=-1))
                inside, column = _in_slice(safe, valid, v0, logits.shape[1])
                target = torch.where(inside, logits.gather(1, column).squeeze(1), target)
                del logits
            losses = torch.where(valid, lse - target, torch.zeros_like(lse))
            divisor = divisor.to(acc)
            loss = losses.sum() / divisor
        ctx.save_for_backward(hidden, weight, safe, valid, lse, divisor)
        ctx.slice_rows, ctx.dtype = slice_rows, dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        hidden, weight, safe, valid, lse, divisor = ctx.saved_tensors
        dtype, slice_rows = ctx.dtype, ctx.slice_rows
        with torch.autocast(hidden.device.type, enabled=False):
            h = hidden.to(dtype)
            scale = (grad_loss.to(lse.dtype) / divisor) * valid.to(lse.dtype)
            grad_h = torch.zeros(h.shape, dtype=lse.dtype, device=h.device)
            grad_w = torch.empty_like(weight) if ctx.needs_input_grad[1] else None
            for v0 in range(0, weight.shape[0], slice_rows):
                w = weight[v0:v0 + slice_rows].to(dtype)
                logits = (h @ w.T).to(lse.dtype)
                probs = torch.exp_(logits.sub_(lse[:, None]))
                inside, column = _in_slice(safe, valid, v0, w.shape[0])
                probs.scatter_add_(1, column, -inside.to(probs.dtype)[:, None])  # minus one at each label
                grad_logits = probs.mul_(scale[:, None]).to(dtype)
                del logits, probs
                if grad_w is not None:
                    grad_w[v0:v0 + w.shape[0]] = (grad_logits.T @ h).to(weight.dtype)
                if ctx.needs_input_grad[0]:
                    grad_h.add_(grad_logits @ w)
                del grad_logits
        grad_hidden = grad_h.to(hidden.dtype) if ctx.needs_input_grad[0] else None
        return grad_hidden, grad_w, None, None, None


def chunked_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                                 num_items_in_batch: Optional[int] = None,
                                 slice_bytes: int = SLICE_BYTES) -> torch.Tensor:
    """Mean cross-entropy of ``hidden @ weight.T`` against ``labels`` (``-100`` ignored), or their
    sum divided by ``num_items_in_batch`` when given (the Trainer's gradient-accumulation
    normalisation), without the logits: ``hidden`` [tokens, hidden], ``weight`` [vocab, hidden],
    ``labels`` [tokens]."""
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden must be [tokens, {weight.shape[-1]}] and weight [vocab, hidden], got "
                         f"{tuple(hidden.shape)} and {tuple(weight.shape)}")
    if labels.shape != hidden.shape[:1]:
        raise ValueError(f"labels must be [tokens] = [{hidden.shape[0]}], got {tuple(labels.shape)}")
    if num_items_in_batch is not None:  # a tensor stays on its device: no host synchronisation
        divisor = torch.as_tensor(num_items_in_batch, device=hidden.device)
    else:
        divisor = (labels != IGNORE_INDEX).sum().clamp_(min=1)
    rows = vocab_slice(hidden.shape[0], weight.shape[0], slice_bytes)
    return ChunkedLinearCrossEntropy.apply(hidden, weight, labels, divisor, rows)


def _causal_lm_forward(self, input_ids=None, labels=None, num_items_in_batch=None, **kwargs):
    """A causal LM's forward whose loss never materializes the logits (they come back as None);
    without ``labels`` (generation, evaluation) the model's own forward runs."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    if labels is None:
        return type(self).forward(self, input_ids=input_ids, **kwargs)
    kwargs.pop("return_dict", None)
    hidden = self.model(input_ids=input_ids, **kwargs).last_hidden_state
    shifted = torch.nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:].to(hidden.device)
    loss = chunked_linear_cross_entropy(hidden.reshape(-1, hidden.shape[-1]), self.lm_head.weight,
                                        shifted.reshape(-1), num_items_in_batch, self._optstate_slice_bytes)
    return CausalLMOutputWithPast(loss=loss, logits=None)


def has_chunked_loss(model) -> bool:
    """Whether :func:`use_chunked_loss` gave ``model`` the chunked loss."""
    return getattr(model, "_optstate_slice_bytes", None) is not None


def use_chunked_loss(model: torch.nn.Module, slice_bytes: int = SLICE_BYTES) -> torch.nn.Module:
    """Give a Hugging Face causal LM (``model.model`` + ``model.lm_head`` without bias, Llama,
    Mistral, Qwen) the chunked loss: its forward with ``labels`` returns the same loss with
    ``logits=None``. Returns ``model``."""
    head = getattr(model, "lm_head", None)
    if not isinstance(getattr(model, "model", None), torch.nn.Module) or not isinstance(head, torch.nn.Linear):
        raise ValueError(f"model must be a causal LM with .model and a Linear .lm_head, got {type(model).__name__}")
    if head.bias is not None:
        raise ValueError("model.lm_head has a bias: the chunked loss supports bias-free heads only")
    if int(slice_bytes) < 1:
        raise ValueError(f"slice_bytes must be a positive number of bytes, got {slice_bytes!r}")
    model._optstate_slice_bytes = int(slice_bytes)
    model.forward = types.MethodType(_causal_lm_forward, model)
    return model
