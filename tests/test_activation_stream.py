"""Activation offload (schedule/activation_stream.py): the inputs activation checkpointing keeps are
in host memory between forward and recompute, their device storage freed, and training equals the
same run without the offload bit for bit (reentrant and non-reentrant checkpointing, with and
without weight streaming, gradient accumulation, a Hugging Face Llama)."""
import pytest
import torch
from torch import nn

import optstate_core as oc
from test_weight_stream import DEPTH, WIDTH, build, data, train, train_lm, wrapped


def params_of(model):
    return [p.detach().clone() for p in model.parameters()]


def run(checkpointing, offload, stream=False, accumulate=1, steps=3):
    model = build(checkpointing)
    opt = wrapped(model, "8bit")
    weights = oc.stream_weights(model, opt) if stream else None
    acts = oc.offload_activations(model) if offload else None
    losses = train(model, opt, steps=steps, accumulate=accumulate)
    with (weights.gathered() if stream else torch.no_grad()):
        final = params_of(model)
    return losses, final, acts, model


@pytest.mark.parametrize("checkpointing", ["reentrant", "non_reentrant"])
@pytest.mark.parametrize("stream", [False, True], ids=["weights-resident", "weights-streamed"])
def test_offloaded_training_equals_the_run_without_offload(checkpointing, stream):
    ref_losses, ref_params, _, _ = run(checkpointing, offload=False, stream=stream)
    losses, final, acts, _ = run(checkpointing, offload=True, stream=stream)
    assert losses == ref_losses
    assert all(torch.equal(a, b) for a, b in zip(final, ref_params))
    # each step: out after the forward, back in for the recompute, all but the last prefetch + 1 = 2 layers
    one = 4 * 16 * WIDTH * 4  # a layer input: batch 4 x 16 tokens x WIDTH fp32
    assert acts.d2h_bytes == acts.h2d_bytes == 3 * (DEPTH - 2) * one
    assert acts.host_bytes() == 0  # nothing left out after backward


def test_offloaded_training_equals_under_gradient_accumulation():
    ref_losses, ref_params, _, _ = run("reentrant", offload=False, accumulate=2)
    losses, final, acts, _ = run("reentrant", offload=True, accumulate=2)
    assert losses == ref_losses and all(torch.equal(a, b) for a, b in zip(final, ref_params))
    assert acts.host_bytes() == 0


@pytest.mark.parametrize("checkpointing", ["reentrant", "non_reentrant"])
def test_between_forward_and_backward_the_inputs_hold_no_device_storage(checkpointing):
    model = build(checkpointing)
    acts = oc.offload_activations(model)
    inputs = []
    hooks = [layer.register_forward_pre_hook(lambda m, a: inputs.append(a[0])) for layer in model.layers]
    ids, target = data(0)
    loss = nn.functional.cross_entropy(model(ids).flatten(0, 1), target.flatten())
    for h in hooks:
        h.remove()
    assert [x.untyped_storage().nbytes() == 0 for x in inputs] == [True] * (DEPTH - 2) + [False, False]
    assert acts.host_bytes() == (DEPTH - 2) * inputs[0].numel() * 4
    loss.backward()
    assert acts.host_bytes() == 0
    pooled = acts.pooled_bytes()
    nn.functional.cross_entropy(model(ids).flatten(0, 1), target.flatten()).backward()
    assert acts.pooled_bytes() == pooled  # the second step reuses the first step's host buffers


def test_nothing_moves_without_checkpointing_or_without_gradients():
    model = build("none")
    acts = oc.offload_activations(model)
    ids, target = data(0)
    nn.functional.cross_entropy(model(ids).flatten(0, 1), target.flatten()).backward()
    assert acts.d2h_bytes == 0  # autograd keeps much more than the input: nothing to gain
    model = build("reentrant")
    acts = oc.offload_activations(model)
    with torch.no_grad():
        model(ids)
    assert acts.d2h_bytes == 0  # no recompute will come
    model.embed.register_forward_hook(lambda m, a, out: out.requires_grad_())  # as HF's enable_input_require_grads
    with torch.no_grad():
        model(ids)
    assert acts.d2h_bytes == 0  # inputs that require gradients, but a forward without them


def test_a_layer_whose_output_is_its_input_keeps_it():
    class Identity(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(()))

        def forward(self, x):
            return x.view_as(x)

    layers = nn.ModuleList(Identity() for _ in range(4))
    acts = oc.offload_activations(nn.Sequential(), layers=layers)
    x = torch.randn(3, 5, requires_grad=True) * 1
    with torch.no_grad():
        for layer in layers:
            layer(x)
    assert acts.d2h_bytes == 0 and x.untyped_storage().nbytes() == 15 * 4


def test_a_hugging_face_llama_trains_bit_for_bit_with_weights_streamed_and_inputs_offloaded():
    from optstate_core.apps.llama import NAMED_SHAPES, build_model
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    runs = []
    for offload in (False, True):
        model = build_model(NAMED_SHAPES["tiny"], "cpu", torch.float32, checkpointing=True, seed=3)
        opt = wrapped(model, "8bit")
        oc.stream_weights(model, opt)
        acts = oc.offload_activations(model, prefetch=0) if offload else None
        runs.append(train_lm(model, opt, ids, steps=3))
    assert runs[0] == runs[1]
    assert acts.d2h_bytes == acts.h2d_bytes == 3 * ids.numel() * 64 * 4  # the first of 2 layers' input, 3 steps


def test_prefetch_zero_moves_every_layer_but_the_last():
    model = build("reentrant")
    acts = oc.offload_activations(model, prefetch=0)
    ids, target = data(0)
    nn.functional.cross_entropy(model(ids).flatten(0, 1), target.flatten()).backward()
    assert acts.d2h_bytes == (DEPTH - 1) * 4 * 16 * WIDTH * 4


@pytest.mark.parametrize("bad, match", [({"prefetch": -1}, "prefetch"), ({"prefetch": True}, "prefetch"),
                                        ({"layers": [1]}, r"layers\[0\]")])
def test_bad_arguments_are_refused_by_name(bad, match):
    with pytest.raises(ValueError, match=match):
        oc.offload_activations(build("reentrant"), **bad)


def test_close_brings_everything_back_and_stops():
    model = build("reentrant")
    acts = oc.offload_activations(model)
    inputs = []
    hooks = [layer.register_forward_pre_hook(lambda m, a: inputs.append(a[0])) for layer in model.layers]
    ids, target = data(0)
    loss = nn.functional.cross_entropy(model(ids).flatten(0, 1), target.flatten())
    acts.close()
    assert all(x.untyped_storage().nbytes() for x in inputs)
    loss.backward()  # the recompute finds its inputs where they were
    for h in hooks:
        h.remove()
    moved = acts.d2h_bytes
    model(ids).sum().backward()
    assert acts.d2h_bytes == moved


def test_the_wrap_option_offloads_with_the_stream_and_close_ends_both():
    ref_losses, ref_params, _, _ = run("non_reentrant", offload=False, stream=True)
    model = build("non_reentrant")
    opt = oc.wrap(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1), "8bit-stream",
                  release_bucket_bytes=4096, offload_activations=True)
    stream = opt.stream_weights(model)
    assert train(model, opt) == ref_losses
    assert stream.activations.d2h_bytes == 3 * (DEPTH - 2) * 4 * 16 * WIDTH * 4
    stream.close()
    moved = stream.activations.d2h_bytes
    train(model, opt, steps=1)
    assert stream.activations.d2h_bytes == moved


@pytest.mark.parametrize("options, match", [({"offload_activations": True}, "needs stream_weights=True"),
                                            ({"stream_weights": True, "offload_activations": "yes"},
                                             "offload_activations")])
def test_the_wrap_option_is_refused_by_name(options, match):
    model = build("reentrant")
    with pytest.raises(ValueError, match=match):
        oc.wrap(torch.optim.AdamW(model.parameters()), "8bit", **options)


class OutsideResidual(nn.Module):
    """Checkpointed blocks whose residual is added by the caller, after the block: the input is read
    again once the block's forward is over."""

    def __init__(self, reentrant: bool):
        super().__init__()
        torch.manual_seed(0)
        self.reentrant = reentrant
        self.layers = nn.ModuleList(nn.Sequential(nn.LayerNorm(WIDTH), nn.Linear(WIDTH, WIDTH), nn.GELU())
                                    for _ in range(DEPTH))

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint
        for block in self.layers:
            x = x + checkpoint(block, x, use_reentrant=self.reentrant)
        return x


@pytest.mark.parametrize("reentrant", [True, False])
def test_an_input_the_caller_reads_after_the_layer_goes_out_only_when_the_next_layer_starts(reentrant):
    x0 = torch.randn(4, 16, WIDTH, generator=torch.Generator().manual_seed(3))
    runs = []
    for offload in (False, True):
        model = OutsideResidual(reentrant)
        acts = oc.offload_activations(model) if offload else None
        x = x0.clone().requires_grad_()
        y = model(x)
        y.square().mean().backward()
        runs.append((y.detach(), x.grad, [p.grad for p in model.parameters()]))
    (y_ref, gx_ref, g_ref), (y, gx, g) = runs
    assert torch.equal(y, y_ref) and torch.equal(gx, gx_ref) and all(torch.equal(a, b) for a, b in zip(g, g_ref))
    assert acts.d2h_bytes == acts.h2d_bytes == (DEPTH - 2) * x0.numel() * 4


@pytest.mark.parametrize("how", ["argument", "config"])
def test_a_training_forward_that_returns_the_hidden_states_is_refused_before_it_runs(how):
    from optstate_core.apps.llama import NAMED_SHAPES, build_model
    model = build_model(NAMED_SHAPES["tiny"], "cpu", torch.float32, checkpointing=True, seed=3)
    acts = oc.offload_activations(model, prefetch=0)
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    kwargs = {"output_hidden_states": True} if how == "argument" else {}
    if how == "config":
        model.config.output_hidden_states = True
    with pytest.raises(ValueError, match="output_hidden_states"):
        model(input_ids=ids, labels=ids, **kwargs)
    assert acts.d2h_bytes == 0
    with torch.no_grad():  # no backward to come: nothing is offloaded, the hidden states are whole
        out = model(input_ids=ids, output_hidden_states=True)
    assert all(h.untyped_storage().nbytes() for h in out.hidden_states) and acts.d2h_bytes == 0
