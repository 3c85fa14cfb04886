"""Bad input: a clear error naming the argument, or defined behaviour; nothing is lost."""
import logging

import pytest
import torch

import optstate_core as oc
from helpers import flat_params, mlp, train_steps
from test_invariants import same_state, snapshot


def test_nonfinite_gradient_skips_that_parameter_and_counts(caplog):
    model = mlp(width=128)
    opt = oc.wrap(torch.optim.AdamW(model.parameters()), "8bit")
    train_steps(model, opt, 2)
    before = snapshot(opt, model)
    x, y = torch.randn(8, 32), torch.randint(0, 8, (8,))
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    model[0].weight.grad[3, 4] = float("nan")
    model[2].bias.grad[0] = float("inf")
    w_before = model[0].weight.detach().clone()
    s_before = {k: v.clone() for k, v in opt.state[model[0].weight].items()}
    with caplog.at_level(logging.WARNING, logger="optstate"):
        opt.step()
    assert "non-finite gradient" in caplog.text and "index 0" in caplog.text
    assert torch.equal(model[0].weight, w_before)
    for k, v in opt.state[model[0].weight].items():
        if isinstance(v, oc.EncodedTensor):
            assert all(torch.equal(v.payload[n], s_before[k].payload[n]) for n in v.payload)
        else:
            assert torch.equal(v, s_before[k])
    assert opt.memory_report()["nonfinite_skipped"] == 2
    assert torch.isfinite(flat_params(model)).all()
    assert not torch.equal(flat_params(model), before[0])  # the finite parameters did update


def test_nonfinite_like_torch_when_asked():
    ref_model, model = mlp(), mlp()
    ref = torch.optim.AdamW(ref_model.parameters())
    opt = oc.wrap(torch.optim.AdamW(model.parameters()), "fp32", skip_nonfinite=False)
    for m, o in ((ref_model, ref), (model, opt)):
        m[0].weight.grad = torch.full_like(m[0].weight, float("nan"))
        o.step()
    assert torch.isnan(model[0].weight).all() and torch.isnan(ref_model[0].weight).all()


def test_sparse_gradient_rejected_before_any_update():
    emb = torch.nn.Embedding(100, 64, sparse=True)
    lin = torch.nn.Linear(64, 64)
    opt = oc.wrap(torch.optim.AdamW(list(emb.parameters()) + list(lin.parameters())),
                  named_parameters=[("emb.weight", emb.weight), ("lin.weight", lin.weight), ("lin.bias", lin.bias)])
    lin_before = lin.weight.detach().clone()
    lin(emb(torch.tensor([1, 2, 3]))).sum().backward()
    with pytest.raises(ValueError, match="'emb.weight'.*sparse gradient"):
        opt.step()
    assert torch.equal(lin.weight, lin_before) and len(opt.state) == 0 and opt.step_count == 0


def test_complex_parameters_stay_uncompressed_and_exact():
    torch.manual_seed(0)
    p_ref = torch.nn.Parameter(torch.randn(128, 64, dtype=torch.complex64))
    p = torch.nn.Parameter(p_ref.detach().clone())
    ref = torch.optim.AdamW([p_ref])
    opt = oc.wrap(torch.optim.AdamW([p]), "8bit")
    for _ in range(5):
        g = torch.randn_like(p)
        p_ref.grad, p.grad = g.clone(), g.clone()
        ref.step()
        opt.step()
    assert torch.equal(p, p_ref)
    assert isinstance(opt.state[p]["exp_avg"], torch.Tensor) and opt.state[p]["exp_avg"].is_complex()


def test_frozen_none_grad_and_zero_size_parameters():
    model = mlp(width=128)
    model[0].weight.requires_grad_(False)
    empty = torch.nn.Parameter(torch.zeros(0, 16))
    opt = oc.wrap(torch.optim.AdamW(list(model.parameters()) + [empty]), "8bit")
    x, y = torch.randn(8, 32), torch.randint(0, 8, (8,))
    torch.nn.functional.cross_entropy(model(x), y).backward()
    empty.grad = torch.zeros(0, 16)
    opt.step()
    assert model[0].weight not in opt.state  # frozen: skipped, no state
    assert empty in opt.state and opt.state[empty]["exp_avg"].numel() == 0
    model[2].weight.grad = None
    before = opt.state[model[2].weight]["exp_avg"].clone()
    w = model[2].weight.detach().clone()
    opt.step()
    assert torch.equal(model[2].weight, w)
    assert torch.equal(opt.state[model[2].weight]["exp_avg"].payload["codes"], before.payload["codes"])


@pytest.mark.parametrize("kwargs,match", [
    (dict(chunk_bytes="lots"), "chunk_bytes"),
    (dict(chunk_bytes=0), "chunk_bytes"),
    (dict(chunk_size=0), "chunk_size"),
    (dict(initial_chunk_size=1.5), "initial_chunk_size"),
    (dict(pin_memory="yes"), "pin_memory"),
    (dict(skip_nonfinite=None), "skip_nonfinite"),
    (dict(check_in_backward=1), "check_in_backward"),
    (dict(seed="x"), "seed"),
    (dict(elementwise=1), "elementwise"),
    (dict(policy=object()), "policy"),
])
def test_invalid_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        oc.VirtualOptimizer(torch.optim.AdamW(mlp().parameters()), **kwargs)


def test_invalid_optimizer_and_preset():
    with pytest.raises(ValueError, match="optimizer"):
        oc.wrap(object())
    with pytest.raises(ValueError, match="already a VirtualOptimizer"):
        oc.wrap(oc.wrap(torch.optim.AdamW(mlp().parameters())))
    with pytest.raises(ValueError, match="LBFGS"):
        oc.wrap(torch.optim.LBFGS(mlp().parameters()))
    with pytest.raises(ValueError, match="unknown preset 'int3'"):
        oc.wrap(torch.optim.AdamW(mlp().parameters()), "int3")
    with pytest.raises(ValueError, match="variance_mode"):
        oc.wrap_low_memory_adamw(mlp().parameters(), variance_mode="fp8")


def test_closure_that_raises_changes_nothing():
    model = mlp(width=128)
    opt = oc.wrap(torch.optim.AdamW(model.parameters()), "4bit")
    train_steps(model, opt, 2)
    before = snapshot(opt, model)

    def closure():
        opt.zero_grad()
        model(torch.randn(4, 32)).sum().backward()
        raise KeyError("data loader broke")

    with pytest.raises(KeyError):
        opt.step(closure)
    after = snapshot(opt, model)
    assert torch.equal(before[0], after[0]) and same_state(before[1], after[1]) and before[2] == after[2]


def test_load_state_dict_for_other_parameters_is_rejected_without_change():
    model = mlp(width=128)
    opt = oc.wrap(torch.optim.AdamW(model.parameters()), "8bit")
    train_steps(model, opt, 2)
    before = snapshot(opt, model)
    other = mlp(width=96)
    other_opt = oc.wrap(torch.optim.AdamW(other.parameters()), "8bit")
    train_steps(other, other_opt, 1)
    with pytest.raises(ValueError, match="shape"):
        opt.load_state_dict(other_opt.state_dict())
    fewer = oc.wrap(torch.optim.AdamW(list(model.parameters())[:2]), "8bit")
    with pytest.raises(ValueError, match="parameters"):
        opt.load_state_dict(fewer.state_dict())
    plain = torch.optim.AdamW(other.parameters())
    train_steps(other, plain, 1)
    with pytest.raises(ValueError, match="shape"):
        opt.load_state_dict(plain.state_dict())
    with pytest.raises(ValueError, match="param_groups"):
        opt.load_state_dict({"state": {}})
    after = snapshot(opt, model)
    assert same_state(before[1], after[1]) and before[2] == after[2]


def test_options_are_one_validated_object():
    """Options as data: keywords and a WrapOptions build the same optimizer options; keywords beside
    an object override it; memory_report() shows them; an unknown name is a TypeError naming it;
    an older spelling still works with a DeprecationWarning; profile=True logs each step's timings."""
    model = mlp()
    opts = oc.WrapOptions.build(torch.optim.AdamW(model.parameters()), chunk_bytes="1MiB", seed=3)
    assert opts.chunk_bytes == 2**20 and opts.seed == 3
    a = oc.wrap(torch.optim.AdamW(model.parameters()), "fp32", opts)
    b = oc.wrap(torch.optim.AdamW(model.parameters()), "fp32", chunk_bytes=2**20, seed=3)
    assert a.options == b.options and a.memory_report()["options"] == opts.as_dict()
    assert oc.wrap(torch.optim.AdamW(model.parameters()), "fp32", opts, seed=4).options.seed == 4
    with pytest.raises(TypeError, match="chunk_byte"):
        oc.wrap(torch.optim.AdamW(model.parameters()), "fp32", chunk_byte=1)
    with pytest.warns(DeprecationWarning, match="elementwise"):
        assert oc.wrap(torch.optim.AdamW(model.parameters()), elementwise=False).options.granularity == "tensor"
    opt = oc.wrap(torch.optim.AdamW(model.parameters()), "fp32", profile=True)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("optstate")
    logger.addHandler(handler)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    try:
        train_steps(model, opt, 1)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    assert any("step 1" in r.getMessage() for r in records)
