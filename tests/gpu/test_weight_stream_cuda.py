"""Weight streaming on a GPU (schedule/weight_stream.py): bit for bit the same training as with the
weights resident, on the fused kernels with pinned host copies, for state on the device and in host
memory; the streamed layers hold no device memory between steps (but the two that wait for the next
forward), with pinned host copies, and the bytes copied are those the turn-keeping rule predicts."""
import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import optstate_core as oc

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

WIDTH, DEPTH, VOCAB = 1024, 6, 512


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 4 * WIDTH, bias=False)
        self.down = nn.Linear(4 * WIDTH, WIDTH, bias=False)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList(Block() for _ in range(DEPTH))
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.layers:
            x = checkpoint(block, x, use_reentrant=False)
        return self.head(x)


def _run(preset, stream: bool, steps=4):
    """Losses, the model's state dict (on the host), the absolute peak, and the stream's counters."""
    torch.manual_seed(0)
    model = Model().cuda()
    oc.cast_model(model)
    opt = oc.wrap(torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1), preset, release_gradients=True)
    streamer = oc.stream_weights(model, opt) if stream else None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (4, 256), generator=gen).cuda()
        loss = nn.functional.cross_entropy(model(ids).float().flatten(0, 1), ids.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    torch.cuda.synchronize()
    out = dict(losses=losses, peak=torch.cuda.max_memory_allocated(),
               state={k: v.detach().cpu() for k, v in model.state_dict().items()})
    if streamer is not None:
        out.update(freed=all((p.untyped_storage().nbytes() == 0) == (i >= 2)  # the first two wait for a forward
                             for i, layer in enumerate(model.layers) for p in layer.parameters()),
            pinned=all(h.is_pinned() for layer in streamer.layers for h in layer.host),
            host=streamer.host_bytes(), h2d=streamer.h2d_bytes, d2h=streamer.d2h_bytes)
    del model, opt, streamer
    torch.cuda.empty_cache()
    return out


@pytest.mark.parametrize("preset", ["bf16w-4bit-lean", "bf16w-4bit-lean-offload"])
def test_streamed_training_equals_resident_on_the_gpu(preset):
    steps = 4
    ref = _run(preset, stream=False, steps=steps)
    got = _run(preset, stream=True, steps=steps)
    assert got["losses"] == ref["losses"]
    for key, value in ref["state"].items():
        assert torch.equal(got["state"][key], value), key
    assert got["freed"] and got["pinned"]
    layer = got["host"] // DEPTH
    # in: every layer for the first forward, then each forward and recompute all but the two layers
    # that stay over the turn; out: each layer once a step, after its update
    assert got["h2d"] == DEPTH * layer + (2 * steps - 1) * (DEPTH - 2) * layer
    assert got["d2h"] == steps * got["host"]


def test_a_checkpoint_directory_loads_onto_the_gpu_one_layer_at_a_time(tmp_path):
    """apps.llama.load_streamed(path, "cuda"): the layers' weights land in pinned host memory (none on
    the GPU), the rest on the GPU, and the values are from_pretrained's; a streamed bf16 run from it
    equals the same run from_pretrained resident, bit for bit."""
    transformers = pytest.importorskip("transformers")
    from optstate_core.apps.llama import enable_checkpointing, load_streamed

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp_path, max_shard_size="1MB")
    whole = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).cuda()
    enable_checkpointing(whole)
    streamed = load_streamed(str(tmp_path), "cuda", torch.bfloat16)
    assert all(p.is_cuda and p.untyped_storage().nbytes() == 0 for p in streamed.model.layers.parameters())
    assert streamed.lm_head.weight.is_cuda and streamed.lm_head.weight.untyped_storage().nbytes()
    opts = {m: oc.wrap(torch.optim.AdamW(m.parameters(), lr=1e-3), "bf16w-4bit-lean", release_gradients=True)
            for m in (whole, streamed)}
    stream = oc.stream_weights(streamed, opts[streamed])  # (its state_dict hook reads the host copies)
    assert all(h.is_pinned() for layer in stream.layers for h in layer.host) and stream.d2h_bytes == 0
    sd, whole_sd = streamed.state_dict(), whole.state_dict()
    assert sd.keys() == whole_sd.keys() and all(torch.equal(sd[k].cpu(), whole_sd[k].cpu()) for k in sd)
    with torch.no_grad():  # the rotary frequencies: computed on the GPU here, on the CPU by from_pretrained
        for (name, mine), (_, theirs) in zip(streamed.named_buffers(), whole.named_buffers()):
            mine.copy_(theirs)
    ids = torch.randint(0, 256, (2, 128), generator=torch.Generator().manual_seed(0)).cuda()
    runs = []
    for model in (whole, streamed):
        opt, losses = opts[model], []
        for _ in range(3):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        runs.append((losses, {k: v.detach().cpu() for k, v in model.state_dict().items()}))
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(runs[0][1][k], runs[1][1][k]) for k in runs[0][1])
