"""Weight streaming through Lightning: ``OptStateCallback(..., stream_weights=True)`` (release follows) or a
``"<preset>-stream"`` policy streams the module's decoder layers from the start of the fit, and the fit equals
the same fit with the weights resident, bit for bit; bad values are refused by name."""
import pytest

pytest.importorskip("lightning")

import lightning as L  # noqa: E402
import torch  # noqa: E402
from torch.utils.checkpoint import checkpoint  # noqa: E402

from lightning_helpers import loader, trainer  # noqa: E402
from lightning_helpers import N_IN, N_OUT  # noqa: E402
from optstate_lightning import OptStateCallback  # noqa: E402


class Blocks(L.LightningModule):
    """An input projection, three checkpointed residual blocks (the decoder layers), an output head."""

    def __init__(self, width: int = 64):
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.out = torch.nn.Linear(N_IN, width), torch.nn.Linear(width, N_OUT)
        self.layers = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.LayerNorm(width), torch.nn.Linear(width, width),
                                                              torch.nn.GELU()) for _ in range(3))

    def forward(self, x):
        h = self.inp(x)
        for block in self.layers:
            h = h + checkpoint(block, h, use_reentrant=False)
        return self.out(h)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.01)


def _fit(stream: bool, policy="8bit", **options):
    model = Blocks()
    cb = OptStateCallback(policy, release_gradients=True, release_bucket_bytes=4096, stream_weights=stream, **options)
    trainer(callbacks=[cb], max_epochs=1).fit(model, loader())
    return model, cb


def test_a_streamed_fit_equals_the_resident_fit():
    ref, _ = _fit(False)
    model, cb = _fit(True)
    assert cb.stream is not None and cb.stream.d2h_bytes == cb.optimizers[0].step_count * cb.stream.host_bytes()
    assert all(p.untyped_storage().nbytes() == 0 for p in model.layers[2].parameters())  # home between steps
    sd, ref_sd = model.state_dict(), ref.state_dict()
    assert all(torch.equal(sd[k], ref_sd[k]) for k in ref_sd)


def test_a_stream_preset_streams_as_stream_weights_does_with_release_implied():
    """``OptStateCallback("8bit-stream")``: the ``8bit`` policy, wrapped with ``stream_weights=True`` (release
    on without being asked), streamed from the start of the fit: the same fit as ``stream_weights=True``."""
    ref, _ = _fit(True)
    model = Blocks()
    cb = OptStateCallback("8bit-stream", release_bucket_bytes=4096)
    assert cb.stream_weights and cb.config.policy == "8bit"
    trainer(callbacks=[cb], max_epochs=1).fit(model, loader())
    opt = cb.optimizers[0]
    assert opt.options.stream_weights and opt.release_gradients and cb.stream is opt.weight_stream is not None
    assert all(p.untyped_storage().nbytes() == 0 for p in model.layers[2].parameters())
    sd, ref_sd = model.state_dict(), ref.state_dict()
    assert all(torch.equal(sd[k], ref_sd[k]) for k in ref_sd)


def test_stream_weights_is_a_bool_and_turns_release_on():
    with pytest.raises(ValueError, match="stream_weights must be True or False"):
        OptStateCallback("8bit", stream_weights="yes")
    for policy, stream in (("8bit", True), ("8bit-stream", False)):
        with pytest.raises(ValueError, match="release_gradients=False contradicts stream_weights=True"):
            OptStateCallback(policy, release_gradients=False, stream_weights=stream)
    with pytest.raises(ValueError, match="unknown preset 'int3-stream'"):
        OptStateCallback("int3-stream")
    model = Blocks()
    cb = OptStateCallback("8bit", stream_weights=True)  # release follows
    trainer(callbacks=[cb], max_epochs=1).fit(model, loader())
    assert cb.optimizers[0].release_gradients and cb.stream is not None


def test_offload_activations_as_a_wrap_option_of_the_callback_fits_as_resident():
    """``OptStateCallback(..., stream_weights=True, offload_activations=True)``: the stream the callback
    starts moves the first block's checkpointed input (the last two keep theirs) each step; the same fit."""
    ref, _ = _fit(False)
    model, cb = _fit(True, offload_activations=True)
    acts = cb.stream.activations
    assert acts is not None and acts.d2h_bytes == acts.h2d_bytes > 0 and acts.host_bytes() == 0
    sd, ref_sd = model.state_dict(), ref.state_dict()
    assert all(torch.equal(sd[k], ref_sd[k]) for k in ref_sd)
