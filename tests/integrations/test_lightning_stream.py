"""Weight streaming through Lightning: ``OptStateCallback(..., release_gradients=True, stream_weights=True)``
streams the module's decoder layers from the start of the fit, and the fit equals the same fit with the
weights resident, bit for bit; bad values are refused by name."""
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


def _fit(stream: bool):
    model = Blocks()
    cb = OptStateCallback("8bit", release_gradients=True, release_bucket_bytes=4096, stream_weights=stream)
    trainer(callbacks=[cb], max_epochs=1).fit(model, loader())
    return model, cb


def test_a_streamed_fit_equals_the_resident_fit():
    ref, _ = _fit(False)
    model, cb = _fit(True)
    assert cb.stream is not None and cb.stream.d2h_bytes == cb.optimizers[0].step_count * cb.stream.host_bytes()
    assert all(p.untyped_storage().nbytes() == 0 for p in model.layers[2].parameters())  # home between steps
    sd, ref_sd = model.state_dict(), ref.state_dict()
    assert all(torch.equal(sd[k], ref_sd[k]) for k in ref_sd)


def test_stream_weights_is_a_bool_and_needs_release():
    with pytest.raises(ValueError, match="stream_weights must be True or False"):
        OptStateCallback("8bit", stream_weights="yes")
    model = Blocks()
    with pytest.raises(ValueError, match="release_gradients=True"):
        trainer(callbacks=[OptStateCallback("8bit", stream_weights=True)], max_epochs=1).fit(model, loader())
