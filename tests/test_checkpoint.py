"""Checkpoints: exact continuation, weights_only loading, migration from and to plain torch."""
import io

import pytest
import torch

import optstate_core as oc
from helpers import flat_params, mlp, train_steps, two_groups

PRESETS = {
    "fp32": lambda: oc.make_policy("fp32"),
    "bf16-sr": lambda: oc.make_policy("bf16", momentum_codec=oc.get_codec("bf16", stochastic_rounding=True)),
    "8bit-sr": lambda: oc.make_policy("8bit", variance_codec=oc.get_codec("int8", stochastic_rounding=True)),
    "4bit": lambda: oc.make_policy("4bit", min_int8_elements=0, whole_blocks_1d=False),
    "offload": lambda: oc.make_policy("offload"),
    "warmup": lambda: oc.WarmupPolicy(warmup_steps=4, variance_codec="int8"),
    "adaptive": lambda: oc.AdaptiveWarmupPolicy(warmup_steps=50, patience=2, tol=0.5, variance_codec="int4"),
}


def roundtrip(sd):
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_save_load_continues_bit_exactly(name):
    model = mlp(width=128)
    opt = oc.wrap(torch.optim.AdamW(two_groups(model)), PRESETS[name](), chunk_bytes="8KB")
    train_steps(model, opt, 3, closure=True)
    ckpt = roundtrip({"model": model.state_dict(), "opt": opt.state_dict()})
    expected = train_steps(model, opt, 4, seed=100, closure=True)

    model2 = mlp(width=128, seed=7)
    model2.load_state_dict(ckpt["model"])
    opt2 = oc.wrap(torch.optim.AdamW(two_groups(model2)), PRESETS[name](), chunk_bytes="1GB")
    opt2.load_state_dict(ckpt["opt"])
    assert opt2.step_count == 3
    assert train_steps(model2, opt2, 4, seed=100, closure=True) == expected
    assert torch.equal(flat_params(model2), flat_params(model))


def test_plain_adamw_checkpoint_migrates_in_exactly():
    ref_model, model = mlp(width=128), mlp(width=128)
    ref = torch.optim.AdamW(ref_model.parameters())
    train_steps(ref_model, ref, 3)
    model.load_state_dict(ref_model.state_dict())
    opt = oc.wrap(torch.optim.AdamW(model.parameters()), "fp32")
    opt.load_state_dict(roundtrip(ref.state_dict()))
    assert opt.step_count == 3
    assert train_steps(model, opt, 3, seed=20) == train_steps(ref_model, ref, 3, seed=20)
    assert torch.equal(flat_params(model), flat_params(ref_model))


def test_plain_adamw_checkpoint_migrates_into_compressed_state():
    ref_model, model = mlp(width=128), mlp(width=128)
    ref = torch.optim.AdamW(ref_model.parameters())
    train_steps(ref_model, ref, 3)
    opt = oc.wrap(torch.optim.AdamW(model.parameters()), "8bit")
    opt.load_state_dict(ref.state_dict())
    w_ref, w = ref_model[0].weight, model[0].weight
    enc = opt.state[w]["exp_avg"]
    assert isinstance(enc, oc.EncodedTensor)  # stored as the policy says right after loading
    truth = ref.state[w_ref]["exp_avg"]
    assert (enc.decode() - truth).abs().max() <= truth.abs().max() / 15


def test_export_loads_into_the_unwrapped_optimizer():
    model, ref_model = mlp(width=128), mlp(width=128)
    opt = oc.wrap(torch.optim.AdamW(model.parameters()), "fp32")
    ref = torch.optim.AdamW(ref_model.parameters())
    train_steps(model, opt, 3)
    train_steps(ref_model, ref, 3)
    plain_model = mlp(width=128)
    plain_model.load_state_dict(model.state_dict())
    plain = torch.optim.AdamW(plain_model.parameters())
    plain.load_state_dict(roundtrip(opt.export_state_dict()))
    assert train_steps(plain_model, plain, 3, seed=30) == train_steps(ref_model, ref, 3, seed=30)


def test_export_of_compressed_state_is_close():
    model = mlp(width=128)
    opt = oc.wrap(torch.optim.AdamW(model.parameters()), "4bit")
    train_steps(model, opt, 3)
    exported = opt.export_state_dict()
    plain = torch.optim.AdamW(mlp(width=128).parameters())
    plain.load_state_dict(exported)
    st = exported["state"][0]
    assert st["exp_avg"].dtype == torch.float32 and st["exp_avg"].shape == model[0].weight.shape
    assert torch.allclose(st["exp_avg"], opt.state[model[0].weight]["exp_avg"].decode())


def test_newer_format_is_rejected():
    model = mlp(width=128)
    opt = oc.wrap(torch.optim.AdamW(model.parameters()))
    train_steps(model, opt, 1)
    sd = opt.state_dict()
    sd["optstate"] = dict(sd["optstate"], format_version=99)
    with pytest.raises(ValueError, match="format_version 99"):
        opt.load_state_dict(sd)


def test_offline_decode_of_a_checkpoint_file(tmp_path):
    model = mlp(width=128)
    opt = oc.wrap(torch.optim.AdamW(model.parameters()), "8bit")
    train_steps(model, opt, 2)
    torch.save(opt.state_dict(), tmp_path / "opt.pt")
    plain = oc.to_plain_state_dict(torch.load(tmp_path / "opt.pt", weights_only=True))
    ref = opt.export_state_dict()
    assert plain["state"].keys() == ref["state"].keys()
    for pid in plain["state"]:
        for k, v in plain["state"][pid].items():
            assert torch.equal(v, ref["state"][pid][k])
    torch.optim.AdamW(mlp(width=128).parameters()).load_state_dict(plain)
    with pytest.raises(ValueError, match="param_groups"):
        oc.to_plain_state_dict({"state": {}})


@pytest.mark.parametrize("preset", ["4bit", "4bit-all", "8bit", "bf16w-4bit-lean"])
def test_loading_keeps_state_already_in_its_form_word_for_word(preset, monkeypatch):
    """Loading a checkpoint re-encodes nothing whose codec and tier already match the policy: a
    stochastically rounded 4-bit code decoded and encoded again can move (its decoded value does
    not land back on its level exactly), which made a resumed GPU run differ from an uninterrupted
    one. The loaded payloads are the saved ones word for word."""
    from optstate_core.state.master_weights import cast_model
    from optstate_core.step.tiled import TiledStep

    model = mlp(width=128)
    if preset.startswith("bf16w"):
        cast_model(model)
    opt = oc.wrap(torch.optim.AdamW(model.parameters(), lr=1e-3), preset)
    x, y = torch.randn(16, 32).to(next(model.parameters()).dtype), torch.randint(0, 8, (16,))
    for _ in range(2):
        torch.nn.functional.cross_entropy(model(x).float(), y).backward()
        opt.step()
        opt.zero_grad()
    saved = roundtrip(opt.state_dict())

    def no_encode(*args, **kwargs):
        raise AssertionError("load_state_dict re-encoded a state already in its form")
    monkeypatch.setattr(TiledStep, "_encode_tile", no_encode)
    opt.load_state_dict(roundtrip(saved))
    again = opt.state_dict()
    for i, entry in saved["state"].items():
        for key, value in entry.items():
            other = again["state"][i][key]
            if isinstance(value, dict):  # an encoded state: its payload
                for name, t in value["encoded"]["payload"].items():
                    assert torch.equal(t, other["encoded"]["payload"][name]), (i, key, name)
