"""Weight streaming (schedule/weight_stream.py): a streamed run equals the same run with the weights
resident, bit for bit, for every way a layer is visited (reentrant and non-reentrant activation
checkpointing, none), every kind of update path (passthrough fp32, compressed state on the tiled and
CPU paths, master weights, the fused kernels under TRITON_INTERPRET) and gradient accumulation; between
visits the layers hold no device storage; the model's state_dict reads the host copies."""
import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import optstate_core as oc
from optstate_core.state.master_weights import cast_model

WIDTH, DEPTH, VOCAB = 64, 4, 32


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.down = nn.Linear(2 * WIDTH, WIDTH, bias=False)

    def forward(self, x):
        if getattr(self, "gradient_checkpointing", False) and self.training and torch.is_grad_enabled():
            # as transformers' GradientCheckpointingLayer from 5.2x on: the checkpoint inside forward,
            # under the module's hooks (which then run once, outside it; the recompute runs none)
            return checkpoint(self.body, x, use_reentrant=False)
        return self.body(x)

    def body(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class TinyLM(nn.Module):
    def __init__(self, checkpointing: str):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList(Block() for _ in range(DEPTH))
        self.head = nn.Linear(WIDTH, VOCAB)
        self.checkpointing = checkpointing
        for block in self.layers:
            block.gradient_checkpointing = checkpointing == "inside"

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.layers:
            if self.checkpointing in ("none", "inside"):
                x = block(x)
            else:
                x = checkpoint(block, x, use_reentrant=self.checkpointing == "reentrant")
        return self.head(x)


def build(checkpointing="reentrant", dtype=torch.float32):
    torch.manual_seed(0)
    model = TinyLM(checkpointing)
    if dtype != torch.float32:
        cast_model(model, dtype)
    return model


def data(step, micro=0):
    g = torch.Generator().manual_seed(100 * step + micro)
    ids = torch.randint(0, VOCAB, (4, 16), generator=g)
    return ids, torch.randint(0, VOCAB, (4, 16), generator=g)


def train(model, opt, steps=3, accumulate=1):  # noqa: D103
    losses = []
    for s in range(steps):
        for micro in range(accumulate):
            opt.set_step_boundary(micro == accumulate - 1)
            ids, target = data(s, micro)
            loss = nn.functional.cross_entropy(model(ids).float().flatten(0, 1), target.flatten())
            loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def train_lm(model, opt, ids, steps):
    """Steps of a Hugging Face causal LM on one batch (its own loss); the losses."""
    losses = []
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def wrapped(model, preset, **kw):
    return oc.wrap(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1), preset,
                   release_gradients=True, release_bucket_bytes=4096, **kw)


def same_run(preset, checkpointing="reentrant", dtype=torch.float32, accumulate=1, **kw):
    ref = build(checkpointing, dtype)
    ref_losses = train(ref, wrapped(ref, preset, **kw), accumulate=accumulate)
    model = build(checkpointing, dtype)
    opt = wrapped(model, preset, **kw)
    stream = oc.stream_weights(model, opt)
    steps = 3
    losses = train(model, opt, steps=steps, accumulate=accumulate)
    assert losses == ref_losses
    # between steps the streamed layers hold no device storage, but the first prefetch + 1 = 2, which
    # wait for the next forward (their host copies written back all the same)
    for i, layer in enumerate(model.layers):
        assert all((p.untyped_storage().nbytes() == 0) == (i >= 2) for p in layer.parameters()), i
    layer_bytes = stream.host_bytes() // DEPTH
    assert stream.d2h_bytes == steps * stream.host_bytes()  # each layer written back once a step
    if checkpointing != "none" and accumulate == 1:
        # in: every layer before the first forward, then each forward and each recompute all but the
        # two layers that stayed over the turn (the first two for the forward, the last two for backward)
        assert stream.h2d_bytes == DEPTH * layer_bytes + (2 * steps - 1) * (DEPTH - 2) * layer_bytes
    if checkpointing != "none":  # checkpointed: a forward holds one layer (+ the one prefetched) at a time
        seen = []
        hooks = [layer.register_forward_hook(lambda *a: seen.append(stream.device_bytes())) for layer in model.layers]
        with torch.no_grad():
            model(data(0)[0])
        for h in hooks:
            h.remove()
        assert max(seen) <= 2 * max(sum(p.numel() * p.element_size() for p in layer.parameters())
                                    for layer in model.layers)
    streamed_sd, ref_sd = model.state_dict(), ref.state_dict()
    assert streamed_sd.keys() == ref_sd.keys()
    for key in ref_sd:
        assert torch.equal(streamed_sd[key], ref_sd[key]), key
    return model, opt, stream, ref


@pytest.mark.parametrize("checkpointing", ["reentrant", "non_reentrant", "inside", "none"])
def test_streamed_training_equals_resident_for_every_way_a_layer_is_visited(checkpointing):
    same_run("8bit", checkpointing)


def test_a_training_forward_holds_a_window_of_layers_where_the_checkpoint_runs_inside_the_hooks():
    """transformers >= 5.2x checkpoints a decoder layer's forward under its hooks: the recompute runs
    no hook, so the layer comes back on its output's gradient; a training forward still frees each layer."""
    from optstate_core.apps.llama import LlamaShape, build_model
    model = build_model(LlamaShape(hidden=64, layers=6, ffn=128, heads=4, kv_heads=2, vocab=100), "cpu",
                        torch.float32, checkpointing=True, seed=1)
    ref = build_model(LlamaShape(hidden=64, layers=6, ffn=128, heads=4, kv_heads=2, vocab=100), "cpu",
                      torch.float32, checkpointing=True, seed=1)
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(2))
    opt = wrapped(model, "8bit")
    stream = oc.stream_weights(model, opt)
    seen = []
    for layer in model.model.layers:
        layer.register_forward_hook(lambda *a: seen.append(stream.device_bytes()))
    assert train_lm(model, opt, ids, 3) == train_lm(ref, wrapped(ref, "8bit"), ids, 3)
    layer_bytes = stream.host_bytes() // 6
    assert len(seen) == 3 * 6  # one hook call per layer and forward: the recompute runs none
    # the one running and the one prefetched (the two kept over each turn go after their forward)
    assert max(seen) == 2 * layer_bytes
    assert stream.h2d_bytes == 6 * layer_bytes + (2 * 3 - 1) * 4 * layer_bytes


@pytest.mark.parametrize("preset", ["fp32", "4bit"])
def test_streamed_training_equals_resident_for_passthrough_and_4bit_state(preset):
    same_run(preset)


def test_streamed_training_equals_resident_with_master_weights_on_bf16_parameters():
    same_run("bf16w-8bit", dtype=torch.bfloat16)


def test_streamed_training_equals_resident_on_the_fused_kernels():
    same_run("8bit", fused=True)


def test_streamed_training_equals_resident_under_gradient_accumulation():
    same_run("8bit", accumulate=2)


def test_gathered_brings_the_layers_back_and_writes_changes_to_the_host_copies():
    model, opt, stream, ref = same_run("8bit")
    assert stream.host_bytes() == sum(p.numel() * p.element_size() for p in model.layers.parameters())
    assert stream.device_bytes() == 2 * stream.host_bytes() // DEPTH  # the two that wait for the next forward
    with stream.gathered():
        assert stream.device_bytes() == stream.host_bytes()
        with torch.no_grad():
            model.layers[3].up.weight.mul_(2)
    assert stream.device_bytes() == 2 * stream.host_bytes() // DEPTH
    assert torch.equal(model.state_dict()["layers.3.up.weight"], 2 * ref.layers[3].up.weight.detach())
    stream.close()  # streaming ends: the weights stay on the device, the hooks are gone
    assert torch.equal(model.layers[3].up.weight, 2 * ref.layers[3].up.weight.detach())
    train(model, opt, steps=1)
    assert all(p.untyped_storage().nbytes() > 0 for p in model.layers.parameters())


def test_bad_arguments_are_refused_by_name_and_change_nothing():
    model = build()
    plain = oc.wrap(torch.optim.AdamW(model.parameters()), "8bit")
    with pytest.raises(ValueError, match="release_gradients=True"):
        oc.stream_weights(model, plain)
    with pytest.raises(ValueError, match="wrapped optimizer"):
        oc.stream_weights(model, torch.optim.AdamW(model.parameters()))
    opt = wrapped(model, "8bit")
    with pytest.raises(ValueError, match="prefetch"):
        oc.stream_weights(model, opt, prefetch=-1)
    with pytest.raises(ValueError, match=r"layers\[0\]"):
        oc.stream_weights(model, opt, layers=["not a module"])
    other = build()
    with pytest.raises(ValueError, match=r"layers\[0\]\.norm\.weight is not a parameter of the optimizer"):
        oc.stream_weights(model, opt, layers=[other.layers[0]])
    assert all(p.untyped_storage().nbytes() > 0 for p in model.parameters())  # nothing was streamed
    ref = build()
    assert train(model, opt) == train(ref, wrapped(ref, "8bit"))


def test_the_release_batch_shrinks_to_a_layer_so_each_layer_goes_home_once_updated():
    model = build()
    opt = oc.wrap(torch.optim.AdamW(model.parameters(), lr=1e-2), "8bit", release_gradients=True)
    assert opt.options.release_bucket_bytes == 256 * 2**20
    stream = oc.stream_weights(model, opt)
    layer_bytes = sum(p.numel() * p.element_size() for p in model.layers[0].parameters())
    assert opt.options.release_bucket_bytes == layer_bytes == opt.memory_report()["options"]["release_bucket_bytes"]
    resident = []
    for layer in model.layers:  # during backward at most two layers (and the one prefetched) are on the device
        for p in layer.parameters():
            p.register_post_accumulate_grad_hook(lambda p: resident.append(stream.device_bytes()))
    train(model, opt, steps=1)
    assert max(resident) <= 3 * layer_bytes


def test_weights_offloaded_before_the_optimizer_exists_are_streamed_from_there():
    """offload_weights() (a model built layer by layer, or handed to a Trainer that moves it to the
    GPU before it builds the optimizer): the same training, bit for bit, and nothing copied at wrap."""
    ref = build()
    ref_losses = train(ref, wrapped(ref, "8bit"))
    model = build()
    moved = oc.offload_weights(model)
    assert moved == sum(p.numel() * p.element_size() for p in model.layers.parameters())
    assert all(p.untyped_storage().nbytes() == 0 for p in model.layers.parameters())
    before = model.state_dict()  # the host copies stand in for the freed weights
    assert all(torch.equal(before[k], v) for k, v in build().state_dict().items())
    model.to("cpu")  # a framework's move: nothing to move
    opt = wrapped(model, "8bit")
    stream = oc.stream_weights(model, opt)
    assert stream.d2h_bytes == 0 and stream.host_bytes() == moved
    assert train(model, opt) == ref_losses
    for key, value in ref.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key


def test_a_llama_built_one_layer_at_a_time_trains_as_the_one_built_whole():
    """apps.llama.build_model(stream=True): the decoder layers go to host memory one by one as they
    are initialised (never all materialised at once), with the values the whole build gives; streamed
    through a Hugging Face model (its own checkpointing), training equals the resident model's."""
    pytest.importorskip("transformers")
    from optstate_core.apps.llama import LlamaShape, build_model

    shape = LlamaShape(hidden=64, layers=3, ffn=128, heads=4, kv_heads=2, vocab=100)
    whole = build_model(shape, "cpu", torch.float32, checkpointing=True)
    streamed = build_model(shape, "cpu", torch.float32, checkpointing=True, stream=True)
    assert all(p.untyped_storage().nbytes() == 0 for p in streamed.model.layers.parameters())
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    losses = []
    for model in (whole, streamed):
        opt = oc.wrap(torch.optim.AdamW(model.parameters(), lr=1e-3), "8bit", release_gradients=True)
        if model is streamed:
            oc.stream_weights(model, opt)
        losses.append(train_lm(model, opt, ids, steps=3))
    assert losses[0] == losses[1]
    whole_sd, streamed_sd = whole.state_dict(), streamed.state_dict()
    assert all(torch.equal(whole_sd[k], streamed_sd[k]) for k in whole_sd)


@pytest.mark.parametrize("preset", ["8bit", "bf16w-8bit"])
def test_a_streamed_run_resumes_from_its_checkpoint_bit_for_bit(preset):
    """model.state_dict() (the host copies) and the optimizer's state_dict saved mid-run, loaded into
    a fresh streamed model and optimizer (load_state_dict writes through to the host copies): the
    resumed run equals the uninterrupted one."""
    dtype = torch.bfloat16 if preset.startswith("bf16w") else torch.float32
    whole = build(dtype=dtype)
    whole_opt = wrapped(whole, preset)
    oc.stream_weights(whole, whole_opt)
    expected = train(whole, whole_opt, steps=4)
    first = build(dtype=dtype)
    first_opt = wrapped(first, preset)
    oc.stream_weights(first, first_opt)
    assert train(first, first_opt, steps=2) == expected[:2]
    saved = {k: v.clone() for k, v in first.state_dict().items()}, first_opt.state_dict()
    resumed = build(dtype=dtype)
    resumed_opt = wrapped(resumed, preset)
    stream = oc.stream_weights(resumed, resumed_opt)
    resumed.load_state_dict(saved[0])
    resumed_opt.load_state_dict(saved[1])
    assert stream.device_bytes() <= 2 * stream.host_bytes() // DEPTH
    losses = []
    for s in (2, 3):  # the batches the uninterrupted run saw at steps 2 and 3
        ids, target = data(s)
        loss = nn.functional.cross_entropy(resumed(ids).float().flatten(0, 1), target.flatten())
        loss.backward()
        resumed_opt.step()
        resumed_opt.zero_grad()
        losses.append(loss.item())
    assert losses == expected[2:]
    for key, value in whole.state_dict().items():
        assert torch.equal(resumed.state_dict()[key], value), key


@pytest.mark.parametrize("shard_size", [None, "20KB"], ids=["one-file", "sharded"])
def test_a_checkpoint_directory_loads_one_layer_at_a_time_and_trains_as_the_whole_model(tmp_path, shard_size):
    """apps.llama.load_streamed: a Hugging Face checkpoint directory (one file, or shards with their
    index) loaded layer by layer into host memory holds exactly what from_pretrained loads, and a
    streamed run from it equals the resident one."""
    transformers = pytest.importorskip("transformers")
    from optstate_core.apps.llama import enable_checkpointing, load_streamed

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path, **({"max_shard_size": shard_size} if shard_size else {}))
    whole = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    enable_checkpointing(whole)
    streamed = load_streamed(str(tmp_path), "cpu", torch.float32)
    assert all(p.untyped_storage().nbytes() == 0 for p in streamed.model.layers.parameters())
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    losses = []
    for model in (whole, streamed):
        opt = oc.wrap(torch.optim.AdamW(model.parameters(), lr=1e-3), "8bit", release_gradients=True)
        if model is streamed:
            stream = oc.stream_weights(model, opt)
            assert stream.d2h_bytes == 0  # the host copies were made while loading
            sd, whole_sd = model.state_dict(), whole_start
            assert sd.keys() == whole_sd.keys() and all(torch.equal(sd[k], whole_sd[k]) for k in sd)
        else:
            whole_start = {k: v.clone() for k, v in model.state_dict().items()}
        losses.append(train_lm(model, opt, ids, steps=2))
    assert losses[0] == losses[1]


def test_load_streamed_names_a_path_without_weights(tmp_path):
    transformers = pytest.importorskip("transformers")
    from optstate_core.apps.llama import load_streamed

    transformers.LlamaConfig(vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                             num_attention_heads=2).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="has no model.safetensors"):
        load_streamed(str(tmp_path), "cpu")


def test_the_wrap_option_and_the_stream_suffix_equal_calling_stream_weights_bit_for_bit():
    """``wrap(opt, preset, stream_weights=True)``, ``wrap(opt, "<preset>-stream")`` and
    ``OptStateAdamW(preset="<preset>-stream")`` turn release on and, once ``opt.stream_weights(model)``
    starts the stream, train as ``optstate_core.stream_weights`` on a release-wrapped optimizer does."""
    ref = build()
    ref_opt = wrapped(ref, "8bit")
    oc.stream_weights(ref, ref_opt)
    expected = train(ref, ref_opt)
    makers = {
        "option": lambda m: oc.wrap(torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1), "8bit",
                                    stream_weights=True, release_bucket_bytes=4096),
        "suffix": lambda m: oc.wrap(torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1), "8bit-stream",
                                    release_bucket_bytes=4096),
        "class": lambda m: oc.OptStateAdamW(m.parameters(), lr=1e-2, weight_decay=0.1, preset="8bit-stream",
                                            wrap_options={"release_bucket_bytes": 4096}),
    }
    for how, make in makers.items():
        model = build()
        opt = make(model)
        assert opt.options.stream_weights and opt.release_gradients and opt.weight_stream is None, how
        assert opt.policy.describe() == ref_opt.policy.describe(), how
        stream = opt.stream_weights(model)
        assert opt.weight_stream is stream, how
        assert train(model, opt) == expected, how
        assert all(p.untyped_storage().nbytes() == 0 for p in model.layers[3].parameters()), how
        for key, value in ref.state_dict().items():
            assert torch.equal(model.state_dict()[key], value), (how, key)


def test_a_step_before_the_stream_starts_raises_and_changes_nothing():
    """stream_weights=True and no stream: the first released gradient (in backward) and step() raise
    before any update, naming the calls that start it; once started, the run equals a streamed one."""
    ref = build()
    ref_opt = wrapped(ref, "8bit-stream")
    ref_opt.stream_weights(ref)
    expected = train(ref, ref_opt)
    model = build()
    opt = wrapped(model, "8bit-stream")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids, target = data(0)
    with pytest.raises(RuntimeError, match=r"opt\.stream_weights\(model\) or optstate_core\.stream_weights"):
        nn.functional.cross_entropy(model(ids).flatten(0, 1), target.flatten()).backward()
    with pytest.raises(RuntimeError, match="no weight stream was started"):
        opt.step()
    assert opt.step_count == 0 and not opt.state and opt.weight_stream is None
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    opt.zero_grad()
    oc.stream_weights(model, opt)
    assert train(model, opt) == expected


def test_stream_options_and_names_are_refused_by_name():
    model = build()

    def adamw():
        return torch.optim.AdamW(model.parameters())

    with pytest.raises(ValueError, match="stream_weights must be True or False, got 'yes'"):
        oc.wrap(adamw(), "8bit", stream_weights="yes")
    for preset, kw in (("8bit", {"stream_weights": True}), ("8bit-stream", {})):
        with pytest.raises(ValueError, match="release_gradients=False contradicts stream_weights=True"):
            oc.wrap(adamw(), preset, release_gradients=False, **kw)
    with pytest.raises(ValueError, match="stream_weights=False contradicts preset '8bit-stream'"):
        oc.wrap(adamw(), "8bit-stream", stream_weights=False)
    with pytest.raises(ValueError, match="unknown preset 'int3-stream'"):
        oc.wrap(adamw(), "int3-stream")
    with pytest.raises(ValueError, match="unknown preset 'int3-stream'"):
        oc.OptStateAdamW(model.parameters(), preset="int3-stream")
    # a policy cannot carry streaming: make_policy says where the suffix goes instead of dropping it
    with pytest.raises(ValueError, match=r"wrap option.*wrap\(optimizer, 'bf16w-4bit-lean-stream'\)"):
        oc.make_policy("bf16w-4bit-lean-stream")
    assert oc.presets.has_master_weights("bf16w-4bit-lean-stream") and not oc.presets.has_master_weights("int8-stream")
    assert oc.wrap(adamw(), "int8-stream").options.stream_weights  # aliases take the suffix too
    assert not oc.wrap(adamw(), "8bit", release_gradients=True).options.stream_weights
    assert not oc.wrap(adamw(), "8bit").options.release_gradients
    from optstate_core.apps import auto  # the planner plans with release when the weights are to stream
    assert auto.wrap(adamw(), model, stream_weights=True).release_gradients
    assert not auto.wrap(adamw(), model).release_gradients  # (the CPU: no cap, no release)
    opt = oc.wrap(adamw(), "8bit-stream")
    stream = opt.stream_weights(model)
    with pytest.raises(RuntimeError, match="streams its model's weights already"):
        opt.stream_weights(model)
    stream.close()
    assert opt.stream_weights(model) is opt.weight_stream is not stream  # a closed stream can be started again
