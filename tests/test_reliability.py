"""The reliability table: each row is a bad input or fault, run for every preset (reference path on
the CPU; the fused kernels under TRITON_INTERPRET for the rows marked so), with one stated outcome.

Every row asserts its outcome *and* that nothing was lost: after a rejected call the parameters,
the state and ``param_groups`` are unchanged, and training continues with finite updates.
docs/formats.md's "Guarantees" section states the same table in words.
"""
import copy
import gc
import pickle

import pytest
import torch

import optstate_core as oc
from test_invariants import same_state, snapshot

PRESETS = sorted(p for p in oc.PRESETS if p != "default")
COMPRESSED = {p for p in PRESETS if p not in ("fp32", "bf16")}  # presets whose state has int codes and scales
FUSED_PRESETS = ("8bit", "4bit")  # the fused kernels run interpreted on the CPU: a cheap subset


# -- helpers ---------------------------------------------------------------------------------------
def net(seed=0, dtype=torch.float32):
    """A 4096-element weight (compressed by every preset) and small tensors (fp32 unless "-all")."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.GELU(), torch.nn.Linear(128, 8)).to(dtype)


def backward(model, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(16, 32, generator=g).to(next(model.parameters()).dtype)
    y = torch.randint(0, 8, (16,), generator=g)
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    return loss


def train(model, opt, steps, first=0):
    for s in range(first, first + steps):
        opt.zero_grad()
        backward(model, s)
        opt.step()


def wrapped(preset, fused=False, model=None, steps=2, **options):
    model = model if model is not None else net()
    opt = oc.wrap(torch.optim.AdamW(model.parameters(), lr=1e-2), preset, fused=fused or None,
                  named_parameters=model, **options)
    train(model, opt, steps)
    return model, opt


def flat(model):
    return torch.cat([p.detach().reshape(-1).float() for p in model.parameters()])


def frozen(opt, model):
    """Everything a rejected call must leave as it was."""
    params, state, steps = snapshot(opt, model)
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    return params, state, steps, copy.deepcopy(groups), [list(map(id, g["params"])) for g in opt.param_groups]


def assert_unchanged(before, opt, model):
    after = frozen(opt, model)
    assert torch.equal(before[0], after[0]), "parameters changed"
    assert same_state(before[1], after[1]), "state changed"
    assert before[2] == after[2], "step count changed"
    assert before[3] == after[3] and before[4] == after[4], "param_groups changed"


def assert_trains(model, opt, steps=2):
    """Training continues: the step count advances and every parameter with a gradient moves, finitely."""
    start, count = flat(model), opt.step_count
    train(model, opt, steps, first=100)
    now = flat(model)
    assert opt.step_count == count + steps
    assert torch.isfinite(now).all() and not torch.equal(now, start)


def encoded_key(opt, model):
    """(parameter index, state key) of an encoded state, or None when the preset keeps none."""
    for i, p in enumerate(model.parameters()):
        for k, v in opt.state[p].items():
            if isinstance(v, oc.EncodedTensor):
                return i, k
    return None


# -- rows: gradients -------------------------------------------------------------------------------
def bad_gradient(value):
    def row(preset, fused):
        model, opt = wrapped(preset, fused, steps=1)
        opt.zero_grad()
        backward(model, 7)
        w = model[0].weight
        w.grad[3, 4] = value
        before_w = w.detach().clone()
        before_state = snapshot(opt, model)[1][0]
        before_decoded = {k: v.clone() for k, v in opt.get_state(w).items() if torch.is_tensor(v) and v.dim()}
        others = flat(model)[w.numel():].clone()
        opt.step()
        if fused:  # the fused kernels skip the 256-element block of one row: here row 3 (32 columns)
            after = opt.get_state(w)
            assert torch.equal(w[3], before_w[3]) and not torch.equal(w[:3], before_w[:3])
            assert all(torch.equal(after[k][3], v[3]) and not torch.equal(after[k][:3], v[:3])
                       for k, v in before_decoded.items())
        else:  # the reference path skips the whole parameter
            assert torch.equal(w, before_w) and same_state({0: before_state}, {0: snapshot(opt, model)[1][0]})
        assert not torch.equal(flat(model)[w.numel():], others)  # the other parameters stepped
        assert opt.memory_report()["nonfinite_skipped"] == 1
        assert_trains(model, opt, 1)
    return row


def tiny_gradient(preset, fused):
    model, opt = wrapped(preset, fused, steps=1)
    opt.zero_grad()
    backward(model, 7)
    for p in model.parameters():
        p.grad.mul_(1e-30)
    opt.step()
    assert opt.memory_report()["nonfinite_skipped"] == 0 and opt.step_count == 2
    for p in model.parameters():
        for v in oc_state(opt, p).values():
            assert torch.isfinite(v).all()
    assert_trains(model, opt)


def oc_state(opt, p):
    return {k: v for k, v in opt.get_state(p).items() if isinstance(v, torch.Tensor) and v.dim() > 0}


# -- rows: parameter kinds -------------------------------------------------------------------------
def sparse_gradient(preset, fused):
    emb, lin = torch.nn.Embedding(100, 64, sparse=True), torch.nn.Linear(64, 64)
    opt = oc.wrap(torch.optim.AdamW(list(emb.parameters()) + list(lin.parameters())), preset,
                  named_parameters=[("emb.weight", emb.weight), ("lin.weight", lin.weight), ("lin.bias", lin.bias)])
    lin(emb(torch.tensor([1, 2, 3]))).sum().backward()
    before = frozen(opt, torch.nn.ModuleList([emb, lin]))
    with pytest.raises(ValueError, match="'emb.weight'.*sparse gradient"):
        opt.step()
    assert_unchanged(before, opt, torch.nn.ModuleList([emb, lin]))


def like_torch(make_param, grad_like):
    """The parameter steps exactly as under torch.optim.AdamW (its state is never compressed)."""
    def row(preset, fused):
        torch.manual_seed(0)
        p_ref = torch.nn.Parameter(make_param())
        p = torch.nn.Parameter(p_ref.detach().clone())
        ref, opt = torch.optim.AdamW([p_ref]), oc.wrap(torch.optim.AdamW([p]), preset, fused=fused or None)
        for _ in range(3):
            g = grad_like(p)
            p_ref.grad, p.grad = g.clone(), g.clone()
            ref.step()
            opt.step()
        assert torch.equal(p, p_ref)
        opt.load_state_dict(opt.state_dict())
        assert torch.equal(opt.get_state(p)["exp_avg"], ref.state[p_ref]["exp_avg"])
    return row


def frozen_parameter(preset, fused):
    model = net()
    model[0].bias.requires_grad_(False)
    model, opt = wrapped(preset, fused, model=model)
    assert model[0].bias not in opt.state
    assert torch.equal(model[0].bias, net()[0].bias)


def grad_none(preset, fused):
    model, opt = wrapped(preset, fused, steps=1)
    opt.zero_grad()
    backward(model, 7)
    w = model[0].weight
    w.grad = None
    before_w, before_state = w.detach().clone(), snapshot(opt, model)[1][0]
    opt.step()
    assert torch.equal(w, before_w) and same_state({0: before_state}, {0: snapshot(opt, model)[1][0]})
    assert_trains(model, opt, 1)


def zero_size(preset, fused):
    model = net()
    empty = torch.nn.Parameter(torch.zeros(0, 16))
    opt = oc.wrap(torch.optim.AdamW(list(model.parameters()) + [empty]), preset, fused=fused or None)
    for s in range(2):
        opt.zero_grad()
        backward(model, s)
        empty.grad = torch.zeros(0, 16)
        opt.step()
    assert opt.state[empty]["exp_avg"].numel() == 0
    opt.load_state_dict(opt.state_dict())
    assert_trains(model, opt)


def late_param_group(preset, fused):
    model, opt = wrapped(preset, fused, steps=2)
    head = torch.nn.Linear(8, 512)  # 4096 elements: compressed
    ref_head = copy.deepcopy(head)
    hyper = dict(lr=0.05, weight_decay=0.0, betas=(0.8, 0.9), eps=1e-6)
    opt.add_param_group({"params": list(head.parameters()), **hyper})
    ref = torch.optim.AdamW(ref_head.parameters(), **hyper)
    assert opt.param_groups[1]["lr"] == 0.05 and opt.param_groups[0]["lr"] == 1e-2
    for h in (head, ref_head):
        h(torch.randn(4, 8, generator=torch.Generator().manual_seed(3))).square().mean().backward()
    opt.step()
    ref.step()
    for p, q in zip(head.parameters(), ref_head.parameters()):  # the first step decodes zeros: exact
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    sd = opt.state_dict()
    assert sd["param_groups"][1]["betas"] == (0.8, 0.9) and sd["param_groups"][1]["eps"] == 1e-6
    assert_trains(model, opt)


# -- rows: closures --------------------------------------------------------------------------------
def closure_raises(preset, fused):
    model, opt = wrapped(preset, fused)
    before = frozen(opt, model)

    def closure():
        opt.zero_grad()
        backward(model, 5)
        raise KeyError("data loader broke")

    with pytest.raises(KeyError, match="data loader broke"):
        opt.step(closure)
    assert_unchanged(before, opt, model)
    assert_trains(model, opt)


def closure_steps_like_backward(preset, fused):
    """A closure that calls backward and returns the loss tensor: the step returns that tensor and
    updates exactly as backward-then-step does."""
    m1, o1 = wrapped(preset, fused)
    m2, o2 = wrapped(preset, fused)
    seen = []

    def closure():
        o1.zero_grad()
        seen.append(backward(m1, 5))
        return seen[-1]

    out = o1.step(closure)
    assert out is seen[0] and isinstance(out, torch.Tensor)
    o2.zero_grad()
    backward(m2, 5)
    o2.step()
    assert torch.equal(flat(m1), flat(m2))
    assert same_state(snapshot(o1, m1)[1], snapshot(o2, m2)[1])


# -- rows: copies ----------------------------------------------------------------------------------
def copy_mid_training(how):
    def row(preset, fused):
        model, opt = wrapped(preset, fused)
        m2, o2 = how((model, opt))
        train(model, opt, 2, first=10)
        train(m2, o2, 2, first=10)
        assert torch.equal(flat(model), flat(m2))
        assert same_state(snapshot(opt, model)[1], snapshot(o2, m2)[1])
    return row


# -- rows: checkpoints -----------------------------------------------------------------------------
def rejected_checkpoint(corrupt, match):
    """``corrupt(sd, opt, model)`` edits a good state_dict (or returns a replacement); loading it
    raises ValueError matching ``match`` and changes nothing."""
    def row(preset, fused):
        model, opt = wrapped(preset, fused)
        sd = copy.deepcopy(opt.state_dict())
        sd = corrupt(sd, opt, model) or sd
        before = frozen(opt, model)
        with pytest.raises(ValueError, match=match):
            opt.load_state_dict(sd)
        assert_unchanged(before, opt, model)
        assert_trains(model, opt)
    return row


def other_optimizer_sd(model_fn):
    def corrupt(sd, opt, model):
        other = model_fn()
        other_opt = oc.wrap(torch.optim.AdamW(other.parameters()), opt.policy)
        train(other, other_opt, 1)
        return other_opt.state_dict()
    return corrupt


def fewer_params():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 128))


def narrower_net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 96), torch.nn.GELU(), torch.nn.Linear(96, 8))


def wrong_payload_dtype(preset, fused):
    model, opt = wrapped(preset, fused)
    where = encoded_key(opt, model)
    sd = copy.deepcopy(opt.state_dict())
    if where is None:  # raw state only: a float64 tensor is cast to the parameter's dtype, as torch does
        sd["state"][0]["exp_avg"] = sd["state"][0]["exp_avg"].double()
        opt.load_state_dict(sd)
        assert opt.state[model[0].weight]["exp_avg"].dtype == torch.float32
        assert_trains(model, opt)
        return
    index, key = where
    payload = sd["state"][index][key]["encoded"]["payload"]
    name = "codes" if "codes" in payload else "data"
    good = payload[name]
    payload[name] = good.float()
    before = frozen(opt, model)
    with pytest.raises(ValueError, match=rf"parameter {index} \('.*'\) state '{key}': payload '{name}'"):
        opt.load_state_dict(sd)
    assert_unchanged(before, opt, model)
    for bad in (good[:1], good.to("meta")):  # wrong shape; no storage
        payload[name] = bad
        with pytest.raises(ValueError, match=f"payload '{name}'"):
            opt.load_state_dict(sd)
    assert_unchanged(before, opt, model)
    assert_trains(model, opt)


def nan_scales(preset, fused):
    model, opt = wrapped(preset, fused)
    index, key = encoded_key(opt, model)
    sd = copy.deepcopy(opt.state_dict())
    sd["state"][index][key]["encoded"]["payload"]["scales"][0, 0] = float("nan")
    before = frozen(opt, model)
    with pytest.raises(ValueError, match=f"state '{key}': payload 'scales' holds NaN/inf"):
        opt.load_state_dict(sd)
    assert_unchanged(before, opt, model)
    assert_trains(model, opt)


def drop_state_key(sd, opt, model):
    del sd["state"][0]["exp_avg_sq"]


def drop_encoded_field(sd, opt, model):
    where = encoded_key(opt, model)
    if where is None:
        return {"state": sd["state"]}  # no encoded entry: a state_dict without param_groups
    del sd["state"][where[0]][where[1]]["encoded"]["payload"]


def future_version(sd, opt, model):
    sd["optstate"]["format_version"] = 99
    sd["param_groups"][0]["optstate"]["format_version"] = 99


def parameter_dtype_changed(preset, fused):
    """A checkpoint saved for float64 parameters loads into float32 ones: the state follows the
    parameter's dtype (as torch casts), stays in its codec, and training continues."""
    m64, o64 = wrapped(preset, fused, model=net(dtype=torch.float64))
    model, opt = wrapped(preset, fused, steps=0)
    with torch.no_grad():
        for p, q in zip(model.parameters(), m64.parameters()):
            p.copy_(q)
    opt.load_state_dict(o64.state_dict())
    for p in model.parameters():
        for v in opt.state[p].values():
            if isinstance(v, (torch.Tensor, oc.EncodedTensor)) and getattr(v, "dim", lambda: 1)() > 0:
                assert v.dtype == torch.float32
    assert opt.step_count == 2
    train(model, opt, 1, first=2)
    train(m64, o64, 1, first=2)
    assert (flat(model) - flat(m64).float()).abs().max() < 1e-3  # one update is ~lr = 1e-2
    assert_trains(model, opt)


def plain_torch_round_trip(preset, fused):
    """A plain torch AdamW checkpoint loads (compressed as the preset says); the export loads back
    into plain AdamW; both continue like AdamW itself."""
    ref_model = net()
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2)
    train(ref_model, ref, 2)
    model, opt = wrapped(preset, fused, steps=0)
    model.load_state_dict(ref_model.state_dict())
    opt.load_state_dict(ref.state_dict())
    assert opt.step_count == 2
    if preset in COMPRESSED:
        assert isinstance(opt.state[model[0].weight]["exp_avg"], oc.EncodedTensor)
    back = torch.optim.AdamW(ref_model.parameters(), lr=1e-2)
    back.load_state_dict(opt.export_state_dict())
    for p, q in zip(model.parameters(), ref_model.parameters()):
        a, b = back.state[q]["exp_avg"], ref.state[q]["exp_avg"]
        assert a.dtype == b.dtype and (a - b).abs().max() <= b.abs().max() / 7 + 1e-12  # one 4-bit step
    train(model, opt, 1, first=2)
    train(ref_model, ref, 1, first=2)
    assert (flat(model) - flat(ref_model)).abs().max() < 1e-2  # within one update of AdamW
    assert_trains(model, opt)


# -- rows: parameters cast or moved after wrapping -------------------------------------------------
def cast_after_wrapping(dtype):
    """``model.to(dtype)`` after wrapping: the state follows in its codec (codes and scales kept),
    and for fp32 the step is bit-identical to torch AdamW whose state was cast the same way (torch
    alone fails on the mixed dtypes)."""
    def row(preset, fused):
        model, opt = wrapped(preset, fused, steps=2)
        ref_model = copy.deepcopy(model)
        ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2)
        ref.load_state_dict(copy.deepcopy(opt.export_state_dict()))  # like torch's, it shares raw tensors
        forms = {(i, k): (type(v), getattr(v, "codec", None))
                 for i, p in enumerate(model.parameters()) for k, v in opt.state[p].items() if k != "step"}
        model.to(dtype)
        ref_model.to(dtype)
        ref.load_state_dict(ref.state_dict())  # torch's own cast of the state to the parameters' dtype
        train(model, opt, 1, first=2)
        train(ref_model, ref, 1, first=2)
        for (i, key), form in forms.items():  # the same codec, now of the parameter's dtype
            value = opt.state[list(model.parameters())[i]][key]
            assert (type(value), getattr(value, "codec", None)) == form and value.dtype == dtype, (i, key)
        if preset == "fp32" and not fused:
            assert torch.equal(flat(model), flat(ref_model))
        else:  # torch's fp16 Adam goes NaN where eps underflows; the fused kernels compute in fp32
            ok = torch.isfinite(flat(ref_model))
            assert torch.isfinite(flat(model)[ok]).all()
            assert (flat(model)[ok] - flat(ref_model)[ok]).abs().max() < 2e-2  # within one update of AdamW
    return row


def moved_to_meta(preset, fused):
    """``model.to("meta")`` gives the module new Parameter objects (torch's rule for meta): the
    optimizer keeps its own parameters and state, as torch.optim does. With
    ``torch.__future__.set_swap_module_params_on_conversion(True)`` the parameters themselves
    become meta tensors: the step is refused by name before anything changes."""
    model, opt = wrapped(preset, fused)
    own = list(opt.param_groups[0]["params"])
    before = frozen(opt, model)
    model.to("meta")
    assert all(p is not q for p, q in zip(model.parameters(), own))
    assert_unchanged(before, opt, torch.nn.ParameterList(own))
    model, opt = wrapped(preset, fused)
    before = frozen(opt, model)
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model.to("meta")
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)
    assert opt.param_groups[0]["params"][0] is model[0].weight and model[0].weight.is_meta
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    with pytest.raises(ValueError, match=r"parameter '0.weight' \(.*\) moved to the meta device"):
        opt.step()
    after = snapshot(opt, model)
    assert after[2] == before[2] and same_state(before[1], after[1])


# -- rows: options ---------------------------------------------------------------------------------
def invalid_options(preset, fused):
    params = list(net().parameters())
    with pytest.raises(ValueError, match="unknown preset 'int3'"):
        oc.wrap(torch.optim.AdamW(params), "int3")
    for kwargs, match in [(dict(chunk_bytes=0), "chunk_bytes"), (dict(chunk_size=0), "chunk_size"),
                          (dict(initial_chunk_size=-1), "initial_chunk_size"), (dict(staging_bytes=0), "staging_bytes"),
                          (dict(gpu_budget=0), "gpu_budget"), (dict(gpu_budget=-5), "gpu_budget"),
                          (dict(chunk_bytes="lots"), "chunk_bytes"), (dict(chunk_size="4"), "chunk_size"),
                          (dict(seed="1"), "seed"), (dict(chunk_bytes=float("inf")), "chunk_bytes"),
                          (dict(chunk_bytes=float("nan")), "chunk_bytes"), (dict(gpu_budget=1.5), "gpu_budget"),
                          (dict(fused="yes"), "fused"), (dict(offload=1), "offload")]:
        with pytest.raises(ValueError, match=match):
            oc.wrap(torch.optim.AdamW(params), preset, **kwargs)
    for overrides, match in [(dict(warmup_steps="10"), "warmup_steps"), (dict(min_int8_elements=True), "min_int8"),
                             (dict(min_int8_elements=-1), "min_int8"), (dict(momentum_codec="int3"), "int3")]:
        with pytest.raises(ValueError, match=match):
            oc.make_policy(preset, **overrides)


def gpu_budget_without_gpu(preset, fused):
    """A fraction of free GPU memory needs CUDA; a byte budget applies to the parameters' device
    (the CPU here) and changes nothing in the results."""
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="gpu_budget=0.5 is a fraction of free GPU memory"):
            oc.wrap(torch.optim.AdamW(net().parameters()), preset, gpu_budget=0.5)
    m1, _ = wrapped(preset, fused, steps=3)
    m2, _ = wrapped(preset, fused, steps=3, gpu_budget="20KB", staging_bytes="8KB")
    assert torch.equal(flat(m1), flat(m2))


# -- rows: leaks -----------------------------------------------------------------------------------
def live_tensors():
    gc.collect()
    return sum(1 for o in gc.get_objects() if issubclass(type(o), torch.Tensor))  # type(): no lazy attribute hooks


def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def soak(preset, fused):
    """300 steps: the number of live tensors and the resident memory stop growing after warm-up."""
    model, opt = wrapped(preset, fused, steps=50)
    tensors, rss = live_tensors(), rss_bytes()
    train(model, opt, 250, first=50)
    assert live_tensors() == tensors
    assert rss_bytes() - rss < 4 * 2**20


def create_close_cycles(preset, fused):
    """6 wrap / train / checkpoint / close cycles leave no tensors or memory behind."""
    def cycle():
        model, opt = wrapped(preset, fused, steps=2)
        opt.state_dict()
        opt.close()
        assert len(opt.state) == 0

    for _ in range(2):
        cycle()
    tensors, rss = live_tensors(), rss_bytes()
    for _ in range(6):
        cycle()
    assert live_tensors() == tensors
    assert rss_bytes() - rss < 4 * 2**20


# -- the table ---------------------------------------------------------------------------------------
#: (row id, check, expected outcome, runs on the fused kernels too)
TABLE = [
    ("nan-grad", bad_gradient(float("nan")), "that parameter (fused kernels: that 256-element block of its row) and its state untouched, counted; others step", True),
    ("inf-grad", bad_gradient(float("inf")), "as NaN", False),
    ("1e30-grad", bad_gradient(1e30), "as NaN (|g| >= 2**64 overflows the second moment)", True),
    ("1e-30-grad", tiny_gradient, "a normal step; state finite", False),
    ("sparse-grad", sparse_gradient, "ValueError naming the parameter before any update", False),
    ("complex-param", like_torch(lambda: torch.randn(64, 128, dtype=torch.complex64), torch.randn_like),
     "uncompressed, bit-identical to torch AdamW", False),
    ("0-dim-param", like_torch(lambda: torch.tensor(0.5), lambda p: torch.randn(())),
     "uncompressed, bit-identical to torch AdamW", False),
    ("frozen-param", frozen_parameter, "no state, never changed", False),
    ("grad-None", grad_none, "parameter and state untouched; others step", True),
    ("zero-size-param", zero_size, "empty state; steps and checkpoints", False),
    ("late-param-group", late_param_group, "its own hyper-parameters; first step as torch AdamW", False),
    ("closure-raises", closure_raises, "the exception propagates; nothing changed", False),
    ("closure-backward-returns-tensor", closure_steps_like_backward, "returns the tensor; same update", False),
    ("deepcopy", copy_mid_training(copy.deepcopy), "identical continuation", False),
    ("pickle", copy_mid_training(lambda x: pickle.loads(pickle.dumps(x))), "identical continuation", False),
    ("ckpt-param-count", rejected_checkpoint(other_optimizer_sd(fewer_params), "parameters"),
     "ValueError; nothing changed", False),
    ("ckpt-shape", rejected_checkpoint(other_optimizer_sd(narrower_net), "shape"), "ValueError; nothing changed",
     False),
    ("ckpt-param-dtype", parameter_dtype_changed, "loads; state follows the parameter's dtype", False),
    ("ckpt-payload-dtype", wrong_payload_dtype, "ValueError naming parameter, key, payload; nothing changed", True),
    ("ckpt-missing-state-key", rejected_checkpoint(drop_state_key, r"missing state \['exp_avg_sq'\]"),
     "ValueError; nothing changed", False),
    ("ckpt-missing-field", rejected_checkpoint(drop_encoded_field, "malformed|param_groups"),
     "ValueError; nothing changed", False),
    ("ckpt-nan-scales", nan_scales, "ValueError naming the key; nothing changed", False),
    ("ckpt-future-version", rejected_checkpoint(future_version, "newer"), "ValueError; nothing changed", False),
    ("ckpt-plain-torch-and-export", plain_torch_round_trip, "imported and exported; continues like AdamW", False),
    ("cast-double", cast_after_wrapping(torch.float64), "state follows in its codec; steps like torch", True),
    ("cast-half", cast_after_wrapping(torch.float16), "state follows in its codec; steps like torch", True),
    ("to-meta", moved_to_meta, "module's new params: optimizer unchanged; in-place meta refused by name", False),
    ("invalid-options", invalid_options, "ValueError naming the argument", False),
    ("gpu-budget-on-cpu", gpu_budget_without_gpu, "fraction refused; bytes change nothing", False),
    ("soak-300-steps", soak, "no growth in live tensors or RSS", False),
    ("create-close-x6", create_close_cycles, "no growth in live tensors or RSS", False),
]
ROWS = {row_id: check for row_id, check, _, _ in TABLE}
FUSED_ROWS = [row_id for row_id, _, _, fused in TABLE if fused]
SCALES_ONLY = {"ckpt-nan-scales"}  # rows that corrupt a payload's block scales: presets that keep some


@pytest.mark.parametrize("row,preset", [(row, preset) for row in ROWS for preset in PRESETS
                                        if row not in SCALES_ONLY or preset in COMPRESSED])
def test_reference(row, preset):
    ROWS[row](preset, False)


@pytest.mark.parametrize("preset", FUSED_PRESETS)
@pytest.mark.parametrize("row", FUSED_ROWS)
def test_fused_interpreted(row, preset):
    pytest.importorskip("triton")
    ROWS[row](preset, True)

