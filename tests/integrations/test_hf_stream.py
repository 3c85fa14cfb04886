"""Weight streaming through the HF Trainer: ``optim="optstate_adamw..._stream"``, ``optim_args="stream_weights=true"``
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


def run(tmp_path, model, optim_args, callbacks=None, optim="optstate_adamw"):
    args = training_args(tmp_path, optim=optim, max_steps=3, per_device_train_batch_size=2,
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


def test_a_stream_optim_name_streams_without_optim_args_and_trains_as_resident(tmp_path):
    """``optim="optstate_adamw..._stream"``: the preset with ``stream_weights=True`` (release on), and the
    callback the name attaches streams the model at train begin; the same run as the resident one."""
    ref_losses, ref = run(tmp_path / "ref", tiny_llama(), RELEASE)
    model = tiny_llama()
    losses, trainer = run(tmp_path / "streamed", model, "release_bucket_bytes=4096", optim="optstate_adamw_stream")
    assert losses == ref_losses
    opt = oc.unwrap(trainer.optimizer)
    assert opt.options.stream_weights and opt.release_gradients
    assert opt.policy.describe() == oc.make_policy("default").describe()
    callback = next(c for c in trainer.callback_handler.callbacks if isinstance(c, optstate_hf.OptStateCallback))
    assert callback.stream is opt.weight_stream and callback.stream.d2h_bytes == 3 * callback.stream.host_bytes()
    assert all(p.untyped_storage().nbytes() == 0 for p in model.model.layers[2].parameters())
    sd, ref_sd = model.state_dict(), ref.model.state_dict()
    assert all(torch.equal(sd[k], ref_sd[k]) for k in ref_sd)


def test_the_bf16w_stream_name_builds_the_base_preset_with_streaming(tmp_path):
    cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(
        training_args(tmp_path, optim="optstate_adamw_bf16w_4bit_lean_stream", optim_args=None, max_grad_norm=1.0))
    assert kwargs["preset"] == "bf16w-4bit-lean-stream" and kwargs["max_grad_norm"] == 1.0  # routed: release is on
    opt = cls([torch.nn.Parameter(torch.zeros(64, 64, dtype=torch.bfloat16))], **kwargs)
    assert opt.options.stream_weights and opt.release_gradients
    assert opt.policy.describe() == oc.make_policy("bf16w-4bit-lean").describe()


def test_stream_weights_turns_release_on_and_bad_combinations_are_refused(tmp_path):
    """``optim_args="stream_weights=true"`` alone streams (release follows); release off, a contradicting
    ``stream_weights=false`` beside a _stream name, or a callback told not to stream raise, naming them."""
    losses, trainer = run(tmp_path / "on", tiny_llama(), "stream_weights=true")
    assert len(losses) == 3 and oc.unwrap(trainer.optimizer).release_gradients
    assert oc.unwrap(trainer.optimizer).weight_stream is not None
    with pytest.raises(ValueError, match="release_gradients=False contradicts stream_weights=True"):
        run(tmp_path / "off", tiny_llama(), "release_gradients=false,stream_weights=true")
    with pytest.raises(ValueError, match="stream_weights=False contradicts preset '8bit-stream'"):
        run(tmp_path / "contra", tiny_llama(), "stream_weights=false", optim="optstate_adamw_8bit_stream")
    with pytest.raises(ValueError, match=r"OptStateCallback\(stream_weights=False\)"):
        run(tmp_path / "cb", tiny_llama(), None, optim="optstate_adamw_8bit_stream",
            callbacks=[optstate_hf.OptStateCallback(stream_weights=False)])
    with pytest.raises(ValueError, match="stream_weights"):
        optstate_hf.OptStateCallback(stream_weights="yes")
    with pytest.raises(ValueError, match="stream_weights='maybe'"):
        run(tmp_path / "bad", tiny_llama(), "stream_weights=maybe")


def test_offload_activations_in_optim_args_moves_the_checkpointed_inputs_and_trains_as_resident(tmp_path):
    ref_losses, _ = run(tmp_path / "ref", tiny_llama(), RELEASE)
    losses, trainer = run(tmp_path / "streamed", tiny_llama(), "release_bucket_bytes=4096,offload_activations=true",
                          optim="optstate_adamw_stream")
    assert losses == ref_losses
    acts = oc.unwrap(trainer.optimizer).weight_stream.activations
    # the first of 3 layers (the last prefetch + 1 = 2 keep theirs): 2 x 16 tokens x 32 fp32 a step
    assert acts.d2h_bytes == acts.h2d_bytes == 3 * 2 * 16 * 32 * 4
