"""Invariants the earlier torch-optstate broke: groups, schedulers, hooks, state mapping, copies."""
import copy
import pickle

import pytest
import torch

import optstate_core as oc
from helpers import flat_params, mlp, train_steps, two_groups


def snapshot(opt, model):
    state = {}
    for i, p in enumerate(model.parameters()):
        st = opt.state.get(p, {})
        state[i] = {k: (v.clone() if isinstance(v, (torch.Tensor, oc.EncodedTensor)) else v) for k, v in st.items()}
    return flat_params(model).clone(), state, opt.step_count


def same_state(a, b):
    if a.keys() != b.keys():
        return False
    for i in a:
        if a[i].keys() != b[i].keys():
            return False
        for k in a[i]:
            x, y = a[i][k], b[i][k]
            if isinstance(x, oc.EncodedTensor):
                if not all(torch.equal(x.payload[n], y.payload[n]) for n in x.payload):
                    return False
            elif isinstance(x, torch.Tensor):
                if not torch.equal(x, y):
                    return False
            elif x != y:
                return False
    return True


def wrapped(model, preset="8bit", **kw):
    return oc.wrap(torch.optim.AdamW(two_groups(model)), preset, **kw)


def test_param_groups_shared_and_stable():
    model = mlp(width=128)
    opt = wrapped(model, chunk_bytes=4096)
    inner = opt.optimizer
    groups, dicts = opt.param_groups, list(opt.param_groups)
    contents = [dict(g) for g in groups]
    assert groups is inner.param_groups and opt.defaults is inner.defaults
    train_steps(model, opt, 3)
    opt.load_state_dict(opt.state_dict())
    with pytest.raises(RuntimeError):
        opt.step(lambda: (_ for _ in ()).throw(RuntimeError("boom")))
    bad = opt.state_dict()
    bad["state"][0]["exp_avg"]["encoded"]["shape"] = [1, 2]
    with pytest.raises(ValueError):
        opt.load_state_dict(bad)
    assert opt.param_groups is groups and inner.param_groups is groups
    assert all(a is b for a, b in zip(groups, dicts))
    assert [dict(g) for g in groups] == contents


def test_scheduler_drives_inner_lr_and_survives_load():
    model = mlp(width=128)
    opt = wrapped(model)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    lrs = []
    for _ in range(3):
        train_steps(model, opt, 1)
        sched.step()
        lrs.append(opt.optimizer.param_groups[0]["lr"])
    assert lrs == pytest.approx([5e-4, 2.5e-4, 1.25e-4])
    # what Accelerate's prepare does: a state_dict -> load_state_dict round trip
    opt.load_state_dict(opt.state_dict())
    train_steps(model, opt, 1)
    sched.step()
    assert opt.optimizer.param_groups[0]["lr"] == pytest.approx(6.25e-5)


def test_scheduler_on_inner_optimizer_does_not_warn(recwarn):
    model = mlp(width=128)
    inner = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.StepLR(inner, step_size=1)
    opt = oc.wrap(inner)
    train_steps(model, opt, 1)
    sched.step()
    assert not [w for w in recwarn if "lr_scheduler.step()" in str(w.message)]


def test_hooks_fire_once_per_step_not_per_chunk():
    model = mlp(width=128)
    opt = wrapped(model, chunk_bytes=4096)
    calls = []
    opt.register_step_pre_hook(lambda o, a, k: calls.append("pre"))
    opt.register_step_post_hook(lambda o, a, k: calls.append("post"))
    from torch.optim.optimizer import register_optimizer_step_pre_hook
    handle = register_optimizer_step_pre_hook(lambda o, a, k: calls.append("global"))
    try:
        train_steps(model, opt, 2)
    finally:
        handle.remove()
    assert opt.last_step_timings["chunks"] > 1
    assert calls == ["global", "pre", "post"] * 2


class _ScheduledAdamW(torch.optim.AdamW):
    """An optimizer that keeps a schedule outside its state and saves it through its own state_dict
    hooks, as heavyball's do (a post hook adds it, a load pre hook reads it, a load post hook runs)."""

    def __init__(self, params, **kw):
        super().__init__(params, **kw)
        self.schedule_position, self.calls = 0, []
        self.register_state_dict_pre_hook(lambda o: o.calls.append("pre"))
        self.register_state_dict_post_hook(_ScheduledAdamW._store)
        self.register_load_state_dict_pre_hook(_ScheduledAdamW._load)
        self.register_load_state_dict_post_hook(lambda o: o.calls.append("loaded"))

    def step(self, closure=None):
        self.schedule_position += 1
        return super().step(closure)

    @staticmethod
    def _store(opt, state_dict):
        opt.calls.append("post")
        state_dict["schedule"] = {"position": opt.schedule_position}

    @staticmethod
    def _load(opt, state_dict):
        opt.calls.append("load")
        opt.schedule_position = state_dict["schedule"]["position"]


def test_the_wrapped_optimizers_own_state_dict_hooks_run_once_on_it():
    """Hooks the wrapped optimizer registered on itself run on it, once each, in torch's order, before
    the wrapper's own: what they save is in the wrapper's checkpoint and comes back on load."""
    model = mlp(width=128)
    inner = _ScheduledAdamW(model.parameters(), lr=1e-3)
    opt = oc.wrap(inner)
    mine = []
    opt.register_state_dict_post_hook(lambda o, sd: mine.append(("post", o is opt, "schedule" in sd)))
    train_steps(model, opt, 3)
    saved = opt.state_dict()
    assert saved["schedule"] == {"position": 3} and inner.calls == ["pre", "post"]
    assert mine == [("post", True, True)]  # the wrapper's hook runs after the inner's, on the wrapper
    fresh_inner = _ScheduledAdamW(model.parameters(), lr=1e-3)
    fresh = oc.wrap(fresh_inner)
    fresh.load_state_dict(saved)
    assert fresh_inner.schedule_position == 3 and fresh_inner.calls == ["load", "loaded"]


def test_state_is_a_real_mapping_with_one_entry_per_param():
    model = mlp(width=128)
    model[2].weight.requires_grad_(False)
    opt = wrapped(model)
    assert len(opt.state) == 0
    train_steps(model, opt, 2)
    trained = [p for p in model.parameters() if p.requires_grad]
    assert set(opt.state.keys()) == set(trained)
    assert all(isinstance(v, dict) for v in opt.state.values())
    assert opt.optimizer.state is opt.state


def test_deepcopy_and_pickle_continue_identically():
    model = mlp(width=128)
    opt = wrapped(model, chunk_bytes=8192)
    train_steps(model, opt, 3)
    m2, o2 = copy.deepcopy((model, opt))
    m3, o3 = pickle.loads(pickle.dumps((model, opt)))
    ref = train_steps(model, opt, 3, seed=9)
    assert train_steps(m2, o2, 3, seed=9) == ref
    assert train_steps(m3, o3, 3, seed=9) == ref
    assert torch.equal(flat_params(m2), flat_params(model))


def test_add_param_group_after_construction():
    model = mlp(width=128)
    opt = oc.wrap(torch.optim.AdamW(model[0].parameters()))
    train_steps(model, opt, 1)
    opt.add_param_group({"params": list(model[2].parameters()) + list(model[4].parameters()), "lr": 1e-2})
    assert len(opt.param_groups) == 2 and opt.optimizer.param_groups is opt.param_groups
    train_steps(model, opt, 1)
    assert model[2].weight in opt.state and opt.param_groups[1]["lr"] == 1e-2


def test_defaults_match_adamw():
    model = mlp()
    for opt in (oc.OptStateAdamW(model.parameters()), oc.wrap_low_memory_adamw(model.parameters()),
                oc.wrap_max_compression_adamw(model.parameters())):
        ref = torch.optim.AdamW(model.parameters())
        assert opt.defaults["lr"] == ref.defaults["lr"] == 1e-3
        assert opt.defaults["weight_decay"] == ref.defaults["weight_decay"] == 1e-2


def test_train_eval_delegate():
    class WithModes(torch.optim.SGD):
        mode = None

        def train(self):
            self.mode = "train"

        def eval(self):
            self.mode = "eval"

    model = mlp()
    opt = oc.wrap(WithModes(model.parameters(), lr=0.1, momentum=0.9))
    assert opt.eval() is opt and opt.optimizer.mode == "eval"
    opt.train()
    assert opt.optimizer.mode == "train"
    oc.wrap(torch.optim.AdamW(mlp().parameters())).eval()  # no-op for optimizers without modes


def test_memory_bounded_by_chunk_not_tensor_size():
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(512, 2048))  # 1M elements: 8 MiB of fp32 m+v
    opt = oc.wrap(torch.optim.AdamW([p]), "8bit", chunk_bytes="256KB")
    for _ in range(2):
        p.grad = torch.randn_like(p)
        opt.step()
    m = opt.last_step_timings
    assert m["tiles"] > 16
    assert 0 < m["peak_materialized_bytes"] <= 256_000 + 2 * 4 * 2048


def test_results_do_not_depend_on_chunk_size():
    out = []
    for chunk in ("4KB", "64KB", "1GB"):
        model = mlp(width=160)
        opt = wrapped(model, preset=oc.make_policy("4bit", momentum_codec=oc.get_codec("int8", stochastic_rounding=True)),
                      chunk_bytes=chunk)
        train_steps(model, opt, 6)
        out.append(flat_params(model))
    assert torch.equal(out[0], out[1]) and torch.equal(out[0], out[2])


def test_compressed_checkpoint_is_small_and_versioned(tmp_path):
    model = torch.nn.Linear(1024, 1024)
    ref = torch.optim.AdamW(model.parameters())
    opt = oc.wrap(torch.optim.AdamW(model.parameters()), "8bit")
    for o in (ref, opt):
        model.weight.grad = torch.randn_like(model.weight)
        model.bias.grad = torch.randn_like(model.bias)
        o.step()
    torch.save(ref.state_dict(), tmp_path / "ref.pt")
    torch.save(opt.state_dict(), tmp_path / "opt.pt")
    size_ref, size_opt = (tmp_path / "ref.pt").stat().st_size, (tmp_path / "opt.pt").stat().st_size
    assert size_opt < 0.3 * size_ref
    sd = torch.load(tmp_path / "opt.pt", weights_only=True)
    assert sd["optstate"]["format_version"] == 1
