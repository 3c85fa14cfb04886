"""optstate under Hugging Face Accelerate (single process, CPU)."""
from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("accelerate")
from accelerate import Accelerator  # noqa: E402
from accelerate.optimizer import AcceleratedOptimizer  # noqa: E402
from accelerate_testlib import fresh_accelerate, reset_accelerate  # noqa: E402,F401
from accelerate.tracking import GeneralTracker  # noqa: E402

import optstate_accelerate as osa  # noqa: E402
import optstate_core as oc  # noqa: E402
from helpers import batch, flat_params, mlp  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def int8_policy(preset="8bit"):
    return oc.make_policy(preset, min_int8_elements=256)  # the test MLP's weights are small


def setup(policy="8bit", seed=0, accum=1, mixed_precision="no", plain=False, lr=1e-2, **accelerator_kwargs):
    """An Accelerator, the MLP, an (optstate) AdamW and a LambdaLR scheduler, all prepared."""
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=accum, mixed_precision=mixed_precision,
                              **accelerator_kwargs)
    model = mlp(seed)
    inner = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    if plain:
        opt = inner
    else:
        opt = oc.wrap(inner, int8_policy() if policy == "8bit" else policy)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.25 * s))
    model, popt, psched = accelerator.prepare(model, opt, sched)
    return accelerator, model, popt, psched


def train(accelerator, model, popt, psched, micro_batches, start=0, on_sync=None):
    """The canonical Accelerate loop; returns the micro-batch losses."""
    losses = []
    for i in range(start, start + micro_batches):
        x, y = batch(100 + i)
        with accelerator.accumulate(model):
            loss = F.cross_entropy(model(x), y)
            accelerator.backward(loss)
            popt.step()
            psched.step()
            popt.zero_grad()
        if on_sync is not None and accelerator.sync_gradients:
            on_sync(loss)
        losses.append(loss.item())
    return losses


def state_snapshot(vopt):
    """The optimizer state_dict with every tensor cloned (for exact before/after comparisons)."""
    return copy.deepcopy(vopt.state_dict())


def assert_same(a, b, path="sd"):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), path
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, path


# -- prepare ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("preset", ["8bit", "offload"])
def test_prepare_keeps_encoded_state_and_group_sharing(preset):
    accelerator = Accelerator(cpu=True)
    model = mlp(0)
    vopt = oc.wrap(torch.optim.AdamW(model.parameters(), lr=1e-2), int8_policy(preset))
    for i in range(2):  # state exists before prepare
        x, y = batch(i)
        F.cross_entropy(model(x), y).backward()
        vopt.step()
        vopt.zero_grad()
    sched = torch.optim.lr_scheduler.LambdaLR(vopt, lambda s: 0.5 ** s)
    before = state_snapshot(vopt)
    groups = [id(g) for g in vopt.param_groups]

    model, popt, psched = accelerator.prepare(model, vopt, sched)

    assert isinstance(popt, AcceleratedOptimizer) and popt.optimizer is vopt
    assert osa.unwrap_optimizer(popt) is vopt
    # the state_dict -> move_to_device -> load_state_dict round trip of AcceleratedOptimizer
    assert_same(before, vopt.state_dict())
    encoded = [v for st in vopt.state.values() for v in st.values() if isinstance(v, oc.EncodedTensor)]
    assert encoded and all(v.host_tier == (preset == "offload") for v in encoded)
    # group dicts still shared with the inner optimizer, so the scheduler reaches it
    assert [id(g) for g in vopt.param_groups] == groups
    assert vopt.param_groups is vopt.optimizer.param_groups
    x, y = batch(5)
    accelerator.backward(F.cross_entropy(model(x), y))
    popt.step()
    psched.step()
    assert vopt.optimizer.param_groups[0]["lr"] == pytest.approx(0.5e-2)
    assert psched.get_last_lr()[0] == vopt.optimizer.param_groups[0]["lr"]


@pytest.mark.parametrize("on", ["wrapper", "inner"])
def test_scheduler_on_wrapper_or_inner_optimizer(on):
    import warnings

    accelerator = Accelerator(cpu=True)
    model = mlp(0)
    vopt = oc.wrap(torch.optim.AdamW(model.parameters(), lr=1e-2), int8_policy())
    sched = torch.optim.lr_scheduler.StepLR(vopt if on == "wrapper" else vopt.optimizer, step_size=1, gamma=0.5)
    model, popt, psched = accelerator.prepare(model, vopt, sched)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. "lr_scheduler.step() before optimizer.step()"
        for i in range(2):
            x, y = batch(i)
            accelerator.backward(F.cross_entropy(model(x), y))
            popt.step()
            psched.step()
            popt.zero_grad()
    assert vopt.step_count == 2
    assert vopt.optimizer.param_groups[0]["lr"] == pytest.approx(0.25e-2) == psched.get_last_lr()[0]


@pytest.mark.parametrize("mixed_precision", ["no", "bf16"])
def test_fp32_preset_matches_plain_adamw_under_accelerate(mixed_precision):
    """wrap(AdamW, "fp32") behaves exactly like AdamW: prepare, accumulation, scheduler, autocast."""
    runs = []
    for plain in (True, False):
        reset_accelerate()
        acc, model, popt, psched = setup("fp32", accum=2, mixed_precision=mixed_precision, plain=plain)
        losses = train(acc, model, popt, psched, 8)
        runs.append((losses, flat_params(model), psched.get_last_lr()))
    assert runs[0][0] == runs[1][0]
    assert torch.equal(runs[0][1], runs[1][1])
    assert runs[0][2] == runs[1][2] and runs[0][2][0] < 1e-2


@pytest.mark.parametrize("mixed_precision", ["no", "bf16"])
def test_int8_trains_under_mixed_precision(mixed_precision):
    acc, model, popt, psched = setup("8bit", accum=2, mixed_precision=mixed_precision)
    x, y = batch(100)
    first = F.cross_entropy(model(x), y).item()
    train(acc, model, popt, psched, 24)
    vopt = osa.unwrap_optimizer(popt)
    report = vopt.memory_report()
    assert vopt.step_count == 12
    assert report["by_codec"].get("int8", 0) > 0 and report["bits_per_param"] < 24
    assert torch.isfinite(flat_params(model)).all()
    assert F.cross_entropy(model(x), y).item() < first


# -- gradient accumulation -------------------------------------------------------------------------
def test_accumulation_steps_only_on_sync_and_leaves_state_alone():
    acc, model, popt, psched = setup("8bit", accum=3)
    vopt = osa.unwrap_optimizer(popt)
    counts, lrs = [], []
    for i in range(7):
        state, params = state_snapshot(vopt), flat_params(model)
        train(acc, model, popt, psched, 1, start=i)
        counts.append(vopt.step_count)
        lrs.append(vopt.optimizer.param_groups[0]["lr"])
        if not acc.sync_gradients:
            assert_same(state, vopt.state_dict())
            assert torch.equal(params, flat_params(model))
    assert counts == [0, 0, 1, 1, 1, 2, 2]
    assert lrs[:2] == [1e-2] * 2 and lrs[2] == pytest.approx(1e-2 / 1.25)

    # the same updates as a hand-written accumulation loop with the same optimizer, no Accelerate
    reset_accelerate()
    model_ref = mlp(0)
    ref = oc.wrap(torch.optim.AdamW(model_ref.parameters(), lr=1e-2, weight_decay=0.01), int8_policy())
    sched = torch.optim.lr_scheduler.LambdaLR(ref, lambda s: 1.0 / (1.0 + 0.25 * s))
    for i in range(6):
        x, y = batch(100 + i)
        (F.cross_entropy(model_ref(x), y) / 3).backward()
        if i % 3 == 2:
            ref.step()
            sched.step()
            ref.zero_grad()
    x, y = batch(106)
    (F.cross_entropy(model_ref(x), y) / 3).backward()  # the 7th micro-batch: accumulated, not stepped
    assert torch.equal(flat_params(model_ref), flat_params(model))
    assert_same(ref.state_dict()["state"], vopt.state_dict()["state"])


# -- the prepared-optimizer hook -------------------------------------------------------------------
def capture_source(vopt, monkeypatch):
    """Record what attach binds (VirtualOptimizer.bind_step_boundary) without touching internals."""
    bound = []
    original = vopt.bind_step_boundary

    def spy(source):
        bound.append(source)
        original(source)

    monkeypatch.setattr(vopt, "bind_step_boundary", spy)
    return bound


def test_attach_binds_boundary_to_sync_gradients_during_backward(monkeypatch):
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=3)
    model = mlp(0)
    vopt = oc.wrap(torch.optim.AdamW(model.parameters(), lr=1e-2), int8_policy())
    x = torch.cat([batch(i)[0] for i in range(7)])
    y = torch.cat([batch(i)[1] for i in range(7)])
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=64)  # 7 batches
    model, popt, loader = accelerator.prepare(model, vopt, loader)
    bound = capture_source(vopt, monkeypatch)
    handle = osa.attach(accelerator, popt)
    assert len(bound) == 1 and callable(bound[0])
    source = bound[0]

    seen, stepped = [], []
    weight = next(model.parameters())
    hook = weight.register_hook(lambda g: seen.append(source()))  # what the engine reads during backward
    for xb, yb in loader:
        with accelerator.accumulate(model):
            before = vopt.step_count
            accelerator.backward(F.cross_entropy(model(xb), yb))
            popt.step()
            popt.zero_grad()
            stepped.append(vopt.step_count > before)
    hook.remove()
    # micro-batches 3 and 6 close a window; 7 is the end of the dataloader
    assert stepped == [False, False, True, False, False, True, True]
    assert seen == stepped
    accelerator.gradient_state._set_sync_gradients(False)
    assert source() is False

    handle.detach()
    assert bound[-1] is None


def test_attach_again_replaces_and_detach_stops_logging(monkeypatch):
    tracker = RecordingTracker()
    acc, model, popt, psched = setup("8bit", log_with=[tracker])
    acc.init_trackers("optstate-test")
    vopt = osa.unwrap_optimizer(popt)
    bound = capture_source(vopt, monkeypatch)
    first = osa.attach(acc, popt, log_every=1)
    second = osa.attach(acc, vopt, log_every=1)  # the VirtualOptimizer itself is accepted too
    assert bound == [first.source, None, second.source]
    train(acc, model, popt, psched, 2)
    assert [s for s, _ in tracker.logs] == [1, 2]  # one hook, not two
    second.detach()
    first.detach()  # already replaced: a no-op
    train(acc, model, popt, psched, 1, start=2)
    assert len(tracker.logs) == 2 and bound[-1] is None


def test_bad_arguments_raise_and_change_nothing(monkeypatch):
    acc, model, popt, psched = setup(oc.AdaptiveWarmupPolicy(warmup_steps=100, patience=2))
    vopt = osa.unwrap_optimizer(popt)
    bound = capture_source(vopt, monkeypatch)
    with pytest.raises(ValueError, match="accelerator"):
        osa.attach(object(), popt)
    with pytest.raises(ValueError, match="optimizer"):
        osa.attach(acc, torch.optim.SGD(mlp(1).parameters(), lr=0.1))
    with pytest.raises(ValueError, match="log_every"):
        osa.attach(acc, popt, log_every=0)
    with pytest.raises(ValueError, match="prefix"):
        osa.attach(acc, popt, prefix=3)
    assert bound == []
    with pytest.raises(ValueError, match="step"):
        osa.log_metrics(acc, popt, step=-1)
    policy_before = dict(vopt.policy.state_dict())
    with pytest.raises(ValueError, match="loss"):
        osa.observe_loss(acc, popt, torch.ones(2))
    with pytest.raises(ValueError, match="loss"):
        osa.observe_loss(acc, popt, "0.5")
    assert vopt.policy.state_dict() == policy_before
    assert osa.observe_loss(acc, popt, torch.tensor(0.75)) == pytest.approx(0.75)
    assert vopt.policy.best_loss == pytest.approx(0.75)


# -- fp16 / GradScaler -----------------------------------------------------------------------------
def test_fp16_grad_scaler_skip_is_honoured():
    """Accelerate makes no GradScaler on CPU (fp16 needs an accelerator), so install torch's CPU
    GradScaler where Accelerate keeps its own: the AcceleratedOptimizer, backward scaling and the
    scheduler then take exactly the fp16 code path (autocast itself stays off on CPU)."""
    acc = Accelerator(cpu=True, mixed_precision="fp16")
    if acc.scaler is None:  # Accelerate 1.15 on CPU
        acc.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    model = mlp(0)
    vopt = oc.wrap(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01), int8_policy())
    sched = torch.optim.lr_scheduler.LambdaLR(vopt, lambda s: 1.0 / (1.0 + 0.25 * s))
    model, popt, psched = acc.prepare(model, vopt, sched)
    assert popt.scaler is acc.scaler

    def one_step(i, poison=False):
        x, y = batch(100 + i)
        acc.backward(F.cross_entropy(model(x), y))
        if poison:
            next(model.parameters()).grad[0, 0] = float("inf")
        popt.step()
        psched.step()
        popt.zero_grad()

    scale = acc.scaler.get_scale()
    one_step(0)
    one_step(1)
    assert not popt.step_was_skipped and vopt.step_count == 2
    state, params, lr, epoch = state_snapshot(vopt), flat_params(model), psched.get_last_lr(), psched.scheduler.last_epoch
    one_step(2, poison=True)
    assert popt.step_was_skipped and acc.optimizer_step_was_skipped
    assert vopt.step_count == 2 and psched.scheduler.last_epoch == epoch and psched.get_last_lr() == lr
    assert_same(state, vopt.state_dict())
    assert torch.equal(params, flat_params(model))
    assert acc.scaler.get_scale() == scale / 2
    one_step(3)
    assert not popt.step_was_skipped and vopt.step_count == 3 and psched.scheduler.last_epoch == epoch + 1

    # scaling by powers of two is exact: the unskipped steps equal an unscaled run
    reset_accelerate()
    acc, model_ref, popt_ref, psched_ref = setup("8bit")
    for i in (0, 1, 3):
        x, y = batch(100 + i)
        acc.backward(F.cross_entropy(model_ref(x), y))
        popt_ref.step()
        psched_ref.step()
        popt_ref.zero_grad()
    assert torch.equal(flat_params(model_ref), flat_params(model))


# -- save_state / load_state -----------------------------------------------------------------------
def test_save_load_state_continues_exactly(tmp_path):
    acc, model, popt, psched = setup("8bit", accum=2)
    train(acc, model, popt, psched, 8)
    acc.save_state(str(tmp_path / "ckpt"))
    expected = train(acc, model, popt, psched, 8, start=8)
    expected_params = flat_params(model)
    expected_state = osa.unwrap_optimizer(popt).state_dict()

    reset_accelerate()
    acc, model, popt, psched = setup("8bit", accum=2, seed=7)  # different init: the load must overwrite it
    acc.load_state(str(tmp_path / "ckpt"))
    assert osa.unwrap_optimizer(popt).step_count == 4
    resumed = train(acc, model, popt, psched, 8, start=8)
    assert resumed == expected
    assert torch.equal(flat_params(model), expected_params)
    assert_same(expected_state, osa.unwrap_optimizer(popt).state_dict())

    sd = torch.load(tmp_path / "ckpt" / "optimizer.bin", weights_only=True)
    assert sd["optstate"]["step"] == 4
    assert any("encoded" in v for st in sd["state"].values() for v in st.values() if isinstance(v, dict))


def test_adaptive_policy_phase_survives_save_load(tmp_path):
    def policy():
        return oc.AdaptiveWarmupPolicy(warmup_steps=1000, patience=2, tol=0.5, min_int8_elements=256,
                                       variance_codec="int8")

    acc, model, popt, psched = setup(policy(), accum=2)
    vopt = osa.unwrap_optimizer(popt)
    train(acc, model, popt, psched, 4, on_sync=lambda loss: osa.observe_loss(acc, popt, loss))
    assert not vopt.policy.switched and vopt.memory_report()["bits_per_param"] == 64
    train(acc, model, popt, psched, 4, start=4, on_sync=lambda loss: osa.observe_loss(acc, popt, loss))
    assert vopt.policy.switched  # losses did not halve twice: plateau by this policy's definition
    saved = vopt.policy.state_dict()
    acc.save_state(str(tmp_path / "ckpt"))
    expected = train(acc, model, popt, psched, 4, start=8)

    sd = torch.load(tmp_path / "ckpt" / "optimizer.bin", weights_only=True)
    assert sd["optstate"]["policy"] == saved and saved["switched"] is True

    reset_accelerate()
    acc, model, popt, psched = setup(policy(), accum=2)
    vopt = osa.unwrap_optimizer(popt)
    assert not vopt.policy.switched
    acc.load_state(str(tmp_path / "ckpt"))
    assert vopt.policy.state_dict() == saved
    report = vopt.memory_report()
    assert report["compression_active"] and report["by_codec"].get("int8", 0) > 0
    assert train(acc, model, popt, psched, 4, start=8) == expected


# -- metrics ---------------------------------------------------------------------------------------
class RecordingTracker(GeneralTracker):
    name = "recording"
    requires_logging_directory = False

    def __init__(self):
        super().__init__()
        self.logs = []

    @property
    def tracker(self):
        return self

    def log(self, values, step=None, **kwargs):
        self.logs.append((step, dict(values)))


def test_metrics_reach_accelerator_log():
    tracker = RecordingTracker()
    acc, model, popt, psched = setup("8bit", log_with=[tracker])
    acc.init_trackers("optstate-test")
    vopt = osa.unwrap_optimizer(popt)
    osa.attach(acc, popt, log_every=2)
    train(acc, model, popt, psched, 5)
    assert [s for s, _ in tracker.logs] == [2, 4]
    keys = set(vopt.log_metrics())
    for _, values in tracker.logs:
        assert set(values) == keys
        assert 8 < values["optstate/bits_per_param"] < 24 and values["optstate/compression_active"] == 1.0
        assert values["optstate/step_ms"] > 0

    values = osa.log_metrics(acc, popt, step=99, prefix="opt/")
    assert tracker.logs[-1] == (99, values)
    assert values["opt/bits_per_param"] == pytest.approx(vopt.memory_report()["bits_per_param"])
    osa.log_metrics(acc, popt)
    assert tracker.logs[-1][0] == vopt.step_count == 5


# -- the example -----------------------------------------------------------------------------------
def test_example_runs_on_cpu(tmp_path):
    env = dict(os.environ, HF_HOME=str(tmp_path / "hf"), OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "accelerate_train.py"), "--cpu",
                          "--steps", "6", "--accum", "2", "--log-every", "3", "--save", str(tmp_path / "ckpt")],
                         capture_output=True, text=True, timeout=120, env=env, cwd=str(tmp_path))
    assert out.returncode == 0, out.stderr[-2000:]
    assert "trained 6 steps" in out.stdout
    assert "saved" in out.stdout and "bits/param" in out.stdout
    assert (tmp_path / "ckpt" / "optimizer.bin").exists()
