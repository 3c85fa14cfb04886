"""Weight streaming through the HF Trainer: ``optim_args="release_gradients=true,stream_weights=true"``
(or ``OptStateCallback(stream_weights=True)``) streams the decoder layers from the start of training,
and the run equals the same Trainer run with the weights resident, bit for bit; a model whose weights
offload_weights() moved to host memory before the Trainer existed is not moved back by it."""
import pytest
import torch

pytest.importorskip("transformers")

import optstate_core as oc  # noqa: E402
import optstate_hf  # noqa: E402,F401
from hf_testlib import one_thread, training_args  # noqa: E402,F401
from transformers import LlamaConfig, LlamaForCausalLM, Trainer  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

CONFIG = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
              num_key_value_heads=2, max_position_embeddings=16)


def tiny_llama():
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def rows(n=8, seq=16):
    ids = torch.randint(0, 64, (n, seq), generator=torch.Generator().manual_seed(0))
    return [{"input_ids": r, "labels": r.clone()} for r in ids]


def run(tmp_path, model, optim_args, callbacks=None):
    args = training_args(tmp_path, optim="optstate_adamw", max_steps=3, per_device_train_batch_size=2,
                         optim_args=optim_args, logging_steps=1)
    trainer = Trainer(model=model, args=args, train_dataset=rows(), callbacks=callbacks)
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h], trainer


# streaming lowers the release batch to a layer's bytes: a step then spans several batches, and the
# Trainer's max_grad_norm clips by clip_mode's rule for that (per tensor under "auto"); the reference
# runs with the same small batch, so both clip alike
RELEASE = "release_gradients=true,release_bucket_bytes=4096"


def test_stream_weights_in_optim_args_streams_the_layers_and_trains_as_resident(tmp_path):
    ref_losses, ref = run(tmp_path / "ref", tiny_llama(), RELEASE)
    model = tiny_llama()
    losses, trainer = run(tmp_path / "streamed", model, RELEASE + ",stream_weights=true")
    assert losses == ref_losses
    callback = next(c for c in trainer.callback_handler.callbacks if isinstance(c, optstate_hf.OptStateCallback))
    assert callback.stream is not None and callback.stream.d2h_bytes == 3 * callback.stream.host_bytes()
    assert all(p.untyped_storage().nbytes() == 0 for p in model.model.layers[2].parameters())
    sd, ref_sd = model.state_dict(), ref.model.state_dict()
    assert all(torch.equal(sd[k], ref_sd[k]) for k in ref_sd)


def test_weights_offloaded_before_the_trainer_stay_home_and_stream(tmp_path):
    ref_losses, _ = run(tmp_path / "ref", tiny_llama(), RELEASE)
    model = tiny_llama()
    oc.offload_weights(model)
    losses, trainer = run(tmp_path / "streamed", model, RELEASE,
                          callbacks=[optstate_hf.OptStateCallback(stream_weights=True)])
    assert losses == ref_losses


def test_stream_weights_needs_release_and_a_bool(tmp_path):
    with pytest.raises(ValueError, match="release_gradients=True"):
        run(tmp_path, tiny_llama(), "stream_weights=true")
    with pytest.raises(ValueError, match="stream_weights"):
        optstate_hf.OptStateCallback(stream_weights="yes")
