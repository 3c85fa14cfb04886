"""(b) step -> save through torchtitan's checkpoint path -> a fresh container loads -> the next step
is bit-identical to an uninterrupted run (one process; torchtitan's CheckpointManager and DCP)."""
import pytest

pytest.importorskip("torchtitan.components.optimizer")  # a real torchtitan, not a folder of that name

import os  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
import titan_lib as tl  # noqa: E402

import optstate_core as oc  # noqa: E402


# The last row clips each step by the previous step's global norm (every gradient released in its
# own hook): the norm rides in the optimizer's metadata, which the resumed step needs.
@pytest.mark.parametrize("preset,release,keys", [("8bit", False, {}), ("4bit", False, {}), ("8bit", True, {}),
                                                 ("4bit", True, {"clip_mode": "previous", "release_bucket_bytes": 0})])
def test_resume_through_torchtitans_checkpointer_is_bit_identical(tmp_path, preset, release, keys):
    model = tl.build_model()
    optimizers, schedulers = tl.build(model, preset, release, **keys)
    tl.train(model, optimizers, schedulers, 2)
    ckpt = tl.checkpointer(model, optimizers, schedulers, str(tmp_path))
    assert ckpt.save(curr_step=2)
    ckpt.close()
    state_at_save = tl.decoded_state(optimizers)
    tl.train(model, optimizers, schedulers, 2, first=2)
    expected, expected_state = tl.params(model), tl.decoded_state(optimizers)

    model2 = tl.build_model(seed=1)  # other weights: the checkpoint restores them
    optimizers2, schedulers2 = tl.build(model2, preset, release, **keys)
    ckpt2 = tl.checkpointer(model2, optimizers2, schedulers2, str(tmp_path))
    assert ckpt2.load(step=2)
    ckpt2.close()
    assert tl.same(tl.decoded_state(optimizers2), state_at_save)
    assert optimizers2.optimizers[0].step_count == optimizers.optimizers[0].step_count - 2
    tl.train(model2, optimizers2, schedulers2, 2, first=2)
    assert tl.same(tl.params(model2), expected)
    assert tl.same(tl.decoded_state(optimizers2), expected_state)
    assert [g["lr"] for g in optimizers2.optimizers[0].param_groups] == \
           [g["lr"] for g in optimizers.optimizers[0].param_groups]


def test_flat_keys_hold_the_compressed_state():
    """torchtitan's flat layout: state.{fqn}.{name}[.nested], param_groups.{fqn}.{key}; int8 codes
    (not fp32 moments) for the large matrices, and the wrapper's metadata in the first group."""
    model = tl.build_model()
    optimizers, schedulers = tl.build(model, "8bit")
    tl.train(model, optimizers, schedulers, 1)
    flat = optimizers.state_dict()
    codes = flat["state.0.weight.exp_avg.encoded.payload.codes"]
    assert codes.dtype == torch.uint8 and codes.shape == (512, 256)
    assert "state.0.weight.exp_avg_sq.encoded.payload.scales" in flat
    assert flat["state.0.bias.exp_avg"].dtype == torch.float32  # 512 elements: kept fp32 by the preset
    assert flat["param_groups.0.weight.optstate"]["step"] == 1
    assert flat["param_groups.4.bias.lr"] == flat["param_groups.0.weight.lr"]
    assert not any(k.startswith("state.") and ".step." in k for k in flat)


def test_lambda_lr_schedules_the_wrapped_optimizers():
    model = tl.build_model()
    optimizers, schedulers = tl.build(model)
    assert all(isinstance(o, oc.VirtualOptimizer) and isinstance(o, torch.optim.Optimizer)
               for o in optimizers.optimizers)
    assert [s.optimizer for s in schedulers.schedulers] == optimizers.optimizers
    lrs = []
    for s in range(3):
        lrs.append(optimizers.optimizers[0].param_groups[0]["lr"])
        tl.train(model, optimizers, schedulers, 1, first=s)
    assert lrs == pytest.approx([tl.LR / 2, tl.LR, tl.LR])  # linear warmup over 2 steps, then stable


def test_a_checkpoint_of_another_preset_is_refused_naming_the_key(tmp_path):
    """Resuming needs the preset the checkpoint was written with (a stock AdamW checkpoint has
    torchtitan's plain moments): DCP refuses the load, naming the first compressed key it lacks;
    a flat dict handed to load_state_dict directly gets a KeyError naming it."""
    model = tl.build_model()
    optimizers, schedulers = tl.build(model, "fp32")
    tl.train(model, optimizers, schedulers, 1)
    ckpt = tl.checkpointer(model, optimizers, schedulers, str(tmp_path))
    ckpt.save(curr_step=1)
    ckpt.close()
    model2 = tl.build_model()
    optimizers2, schedulers2 = tl.build(model2, "8bit")
    ckpt2 = tl.checkpointer(model2, optimizers2, schedulers2, str(tmp_path))
    from torch.distributed.checkpoint.api import CheckpointException

    with pytest.raises(CheckpointException, match="Missing key in checkpoint state_dict: optimizer.state.0.weight.exp_avg.enc"):
        ckpt2.load(step=1)
    ckpt2.close()
    with pytest.raises(KeyError, match="exp_avg.encoded"):
        optimizers2.load_state_dict(optimizers.state_dict())
