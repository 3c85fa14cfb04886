"""The chunked loss (optstate_core/apps/chunked_loss.py) against torch's cross-entropy over whole logits:
fp64 to 1e-12, fp32 to 1e-5, bf16 weights to the plain bf16 path's own rounding; ignored labels,
the Trainer's num_items_in_batch, several vocabulary slices, and a HF causal LM swapped over."""
import pytest
import torch

from optstate_core.apps.chunked_loss import (chunked_linear_cross_entropy, chunked_loss_bytes, use_chunked_loss,
                                        vocab_slice)

TOKENS, HIDDEN, VOCAB = 37, 16, 1000
SMALL_SLICES = 6 * TOKENS * 256  # slices of 256 rows: 4 of them over the vocabulary


def case(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(TOKENS, HIDDEN, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(VOCAB, HIDDEN, generator=g) / 4).to(dtype).requires_grad_()
    labels = torch.randint(0, VOCAB, (TOKENS,), generator=g)
    labels[[3, 20]] = -100
    labels[5] = VOCAB - 1  # the last slice's last row
    return hidden, weight, labels


def grads(loss, *tensors):
    return torch.autograd.grad(loss, tensors)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_matches_cross_entropy_over_whole_logits(dtype, tol):
    hidden, weight, labels = case(dtype)
    assert vocab_slice(TOKENS, VOCAB, SMALL_SLICES) == 256
    loss = chunked_linear_cross_entropy(hidden, weight, labels, slice_bytes=SMALL_SLICES)
    ref = torch.nn.functional.cross_entropy(hidden.double() @ weight.double().T, labels)
    assert abs(loss.item() - ref.item()) <= tol * ref.item()
    for a, b in zip(grads(loss, hidden, weight), grads(ref, hidden, weight)):
        assert ((a.double() - b).abs().max() / b.abs().max()).item() <= tol


def test_bf16_weights_follow_the_plain_bf16_path():
    """bf16 logits upcast to fp32, as a HF model's loss: the weight gradient within bf16 rounding of the
    plain path's, the hidden gradient closer to fp64 than the plain path's (it sums slices in fp32)."""
    hidden, weight, labels = case(torch.bfloat16)
    loss = chunked_linear_cross_entropy(hidden, weight, labels, slice_bytes=SMALL_SLICES)
    plain = torch.nn.functional.cross_entropy((hidden @ weight.T).float(), labels)
    exact = torch.nn.functional.cross_entropy(hidden.double() @ weight.double().T, labels)
    assert loss.item() == pytest.approx(plain.item(), rel=1e-6)  # one log-sum-exp per slice, then combined
    (gh, gw), (ph, pw), (eh, ew) = grads(loss, hidden, weight), grads(plain, hidden, weight), grads(exact, hidden, weight)
    assert ((gw.float() - pw.float()).abs().max() / pw.float().abs().max()).item() <= 2 ** -7
    assert (gh.double() - eh).abs().max() <= (ph.double() - eh).abs().max() * 1.01


def test_num_items_in_batch_divides_the_sum():
    hidden, weight, labels = case(torch.float64)
    total = torch.nn.functional.cross_entropy(hidden @ weight.T, labels, reduction="sum")
    loss = chunked_linear_cross_entropy(hidden, weight, labels, num_items_in_batch=torch.tensor(100))
    assert loss.item() == pytest.approx(total.item() / 100, rel=1e-12)


def test_every_label_ignored_gives_zero_and_no_gradient():
    hidden, weight, labels = case(torch.float64)
    loss = chunked_linear_cross_entropy(hidden, weight, torch.full_like(labels, -100))
    gh, gw = grads(loss, hidden, weight)
    assert loss.item() == 0 and not gh.any() and not gw.any()


def test_memory_estimate_is_one_slice_not_the_logits():
    tokens, hidden, vocab = 4096, 8192, 128256
    assert chunked_loss_bytes(tokens, hidden, vocab) < 0.1 * 10 * tokens * vocab  # whole logits: 5.3 GB; here 0.4 GB
    rows = vocab_slice(tokens, vocab)
    assert rows % 128 == 0 and 6 * tokens * rows <= 256 * 2**20


def tiny_lm(seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    return LlamaForCausalLM(cfg).double()


def test_a_causal_lm_gets_the_same_loss_and_gradients():
    pytest.importorskip("transformers")
    model = tiny_lm()
    ids = torch.randint(0, 300, (2, 9), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[0, :3] = -100
    ref = model(input_ids=ids, labels=labels).loss
    ref_grads = grads(ref, *model.parameters())
    plain_logits = model(input_ids=ids).logits
    use_chunked_loss(model, slice_bytes=6 * 18 * 128)
    out = model(input_ids=ids, labels=labels)
    assert out.logits is None
    assert out.loss.item() == pytest.approx(ref.item(), rel=1e-6)  # HF upcasts fp64 logits to fp32; we keep fp64
    for a, b in zip(grads(out.loss, *model.parameters()), ref_grads):
        assert (a - b).abs().max().item() <= 1e-6 * max(b.abs().max().item(), 1.0)
    assert torch.equal(model(input_ids=ids).logits, plain_logits)  # without labels: the model's own forward


def test_bad_inputs_are_refused_by_name():
    hidden, weight, labels = case(torch.float32)
    with pytest.raises(ValueError, match="hidden"):
        chunked_linear_cross_entropy(hidden[:, :5], weight, labels)
    with pytest.raises(ValueError, match="labels"):
        chunked_linear_cross_entropy(hidden, weight, labels[:-1])
    with pytest.raises(ValueError, match="lm_head"):
        use_chunked_loss(torch.nn.Linear(2, 2))
    pytest.importorskip("transformers")
    with pytest.raises(ValueError, match="slice_bytes"):
        use_chunked_loss(tiny_lm(), slice_bytes=0)
