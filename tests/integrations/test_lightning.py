"""optstate_lightning on one CPU process: wrapping, accumulation boundaries, precision, the
closure, manual optimization, schedulers, metrics, strategies by name, both Lightning packages."""
import warnings

import pytest

pytest.importorskip("lightning")

import torch  # noqa: E402
from lightning.pytorch.plugins import MixedPrecision  # noqa: E402

import optstate_core as oc  # noqa: E402
from lightning_helpers import Regressor, loader, regression_data, trainer  # noqa: E402
from optstate_lightning import OptStateCallback, OptStateSingleDeviceStrategy  # noqa: E402


def params_of(module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def precision_kwargs(precision: str, init_scale: float = 2.0 ** 16) -> dict:
    """Trainer arguments for a precision. Lightning turns precision='16-mixed' into bf16 on CPU;
    the MixedPrecision plugin with a CPU GradScaler runs real fp16 autocast + loss scaling."""
    if precision == "16-mixed":
        scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
        return {"plugins": [MixedPrecision("16-mixed", "cpu", scaler=scaler)]}
    return {"precision": precision}


# -- wrapping ---------------------------------------------------------------------------------------
def test_callback_wraps_every_fit_once():
    model = Regressor()
    cb = OptStateCallback()
    tr = trainer(callbacks=[cb], max_epochs=1)
    tr.fit(model, loader())
    first = tr.optimizers[0]
    assert isinstance(first, oc.VirtualOptimizer) and type(first.optimizer) is torch.optim.AdamW
    assert cb.optimizers == [first] and first.step_count == 8
    # A second fit calls configure_optimizers again: a new AdamW, wrapped once (not a wrapper of a wrapper).
    tr.fit_loop.max_epochs = 2
    tr.fit(model, loader())
    second = tr.optimizers[0]
    assert second is not first and isinstance(second, oc.VirtualOptimizer)
    assert type(second.optimizer) is torch.optim.AdamW
    assert second.step_count == 8 and model.training_step_calls == 16


def test_same_optimizer_object_reuses_its_wrapper():
    class Cached(Regressor):
        def configure_optimizers(self):
            if not hasattr(self, "_opt"):
                self._opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
            return self._opt

    model, cb = Cached(), OptStateCallback()
    tr = trainer(callbacks=[cb], max_epochs=1)
    tr.fit(model, loader())
    first = tr.optimizers[0]
    tr.fit_loop.max_epochs = 2
    tr.fit(model, loader())
    assert tr.optimizers[0] is first and first.optimizer is model._opt
    assert first.step_count == 16  # the state carried over, as with the unwrapped optimizer


def test_configure_optimizers_route_with_and_without_callback():
    wrapped = Regressor(wrap=lambda opt: oc.wrap(opt, "8bit"), scheduler=True)  # StepLR built on the wrapper
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tr = trainer(max_epochs=1)
        tr.fit(wrapped, loader())
    assert not [w for w in caught if "lr_scheduler.step()" in str(w.message)]
    opt = tr.optimizers[0]
    assert isinstance(opt, oc.VirtualOptimizer) and opt.step_count == 8
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-2 * 0.5 ** 4)
    assert wrapped.losses[-1] < wrapped.losses[0]
    # With the callback too: the user's wrapper is kept (not wrapped again) and metrics get logged.
    model, cb = Regressor(wrap=lambda opt: oc.wrap(opt, "4bit")), OptStateCallback()
    tr = trainer(callbacks=[cb], max_epochs=1)
    tr.fit(model, loader())
    assert cb.optimizers[0] is tr.optimizers[0] and isinstance(tr.optimizers[0].optimizer, torch.optim.AdamW)
    assert "optstate/bits_per_param" in tr.callback_metrics


def test_scheduler_steps_without_warnings(tmp_path):
    from lightning.pytorch.callbacks import LearningRateMonitor
    from lightning.pytorch.loggers import CSVLogger

    model = Regressor(scheduler=True)  # StepLR(step_size=2, gamma=0.5) built on the inner AdamW, per step
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tr = trainer(callbacks=[OptStateCallback(), LearningRateMonitor("step")], accumulate_grad_batches=2,
                     max_epochs=1, logger=CSVLogger(tmp_path), log_every_n_steps=1)
        tr.fit(model, loader())
    messages = [str(w.message) for w in caught]
    assert not [m for m in messages if "lr_scheduler.step()" in m], messages
    opt = tr.optimizers[0]
    assert opt.step_count == 4
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-2 * 0.5 ** 2)  # 4 scheduler steps, halving every 2
    assert tr.lr_scheduler_configs[0].scheduler.optimizer is opt.optimizer  # group dicts shared with the wrapper
    lr_monitor = next(c for c in tr.callbacks if isinstance(c, LearningRateMonitor))
    assert lr_monitor.lrs["lr-AdamW"] == pytest.approx([1e-2] * 4 + [5e-3] * 4)  # read at each batch start


# -- accumulation boundaries -------------------------------------------------------------------------
def test_step_boundary_follows_accumulation(monkeypatch):
    events = []
    original = oc.VirtualOptimizer.set_step_boundary

    def recording(self, will_step):
        events.append(("boundary", bool(will_step)))
        return original(self, will_step)

    monkeypatch.setattr(oc.VirtualOptimizer, "set_step_boundary", recording)

    class Spy(Regressor):
        def on_before_backward(self, loss):
            events.append(("backward", None))

    model = Spy()
    tr = trainer(callbacks=[OptStateCallback()], accumulate_grad_batches=4, max_epochs=2)
    tr.fit(model, loader(n=80))  # 10 batches per epoch: windows of 4, 4 and 2 (the epoch's last batch steps)
    assert [e[0] for e in events] == ["boundary", "backward"] * 20  # set before every backward
    flags = [flag for kind, flag in events if kind == "boundary"]
    per_epoch = [False, False, False, True, False, False, False, True, False, True]
    assert flags == per_epoch * 2
    assert tr.optimizers[0].step_count == 6 == 2 * sum(per_epoch)


# -- precision and the closure ----------------------------------------------------------------------
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "16-mixed"])
def test_closure_runs_once_and_matches_unwrapped(precision):
    """SGD with momentum is not scale-invariant: a closure run twice (doubled gradients) or a
    scaler step without unscaling would change the parameters. With the lossless fp32 preset the
    wrapped run must equal the unwrapped one bit for bit, under each precision."""
    init_scale = 2.0 ** 20  # 16-mixed: the first steps overflow in fp16 and are skipped by the scaler
    runs = {}
    for wrapped in (False, True):
        model = Regressor(optimizer="sgd", lr=1e-3)
        callbacks = [OptStateCallback(policy="fp32")] if wrapped else []
        tr = trainer(callbacks=callbacks, accumulate_grad_batches=3, max_epochs=1,
                     **precision_kwargs(precision, init_scale))
        tr.fit(model, loader(n=144))  # 18 batches, 6 optimizer steps
        runs[wrapped] = (model, tr)
    (plain, plain_tr), (model, tr) = runs[False], runs[True]
    opt = tr.optimizers[0]
    assert isinstance(opt, oc.VirtualOptimizer)
    assert model.training_step_calls == plain.training_step_calls == 18
    assert model.losses == plain.losses
    assert torch.equal(params_of(model), params_of(plain))
    if precision == "16-mixed":
        scaler = tr.precision_plugin.scaler
        assert scaler.get_scale() < init_scale  # overflow happened and steps were skipped ...
        assert 0 < opt.step_count < 6  # ... and the wrapper was not stepped for them
        assert scaler.get_scale() == plain_tr.precision_plugin.scaler.get_scale()
    else:
        assert opt.step_count == 6


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "16-mixed"])
def test_compressed_state_trains_under_each_precision(precision):
    model = Regressor()
    cb = OptStateCallback(policy="8bit")
    tr = trainer(callbacks=[cb], accumulate_grad_batches=2, max_epochs=3,
                 **precision_kwargs(precision, init_scale=2.0 ** 8))  # no fp16 overflow: every step taken
    tr.fit(model, loader())
    opt = tr.optimizers[0]
    codecs = {type(v).__name__ for st in opt.state.values() for v in st.values()}
    assert "EncodedTensor" in codecs
    assert opt.step_count == 12 and model.training_step_calls == 24
    assert sum(model.losses[-4:]) < 0.5 * sum(model.losses[:4])


# -- manual optimization --------------------------------------------------------------------------
def test_manual_optimization():
    runs = {}
    for wrapped in (False, True):
        model = Regressor(optimizer="sgd", lr=1e-3, manual=True, scheduler=True)
        callbacks = [OptStateCallback(policy="fp32")] if wrapped else []
        tr = trainer(callbacks=callbacks, max_epochs=1)
        tr.fit(model, loader())
        runs[wrapped] = (model, tr)
    (plain, _), (model, tr) = runs[False], runs[True]
    opt = model.optimizers()
    assert isinstance(opt, oc.VirtualOptimizer)  # the LightningOptimizer shell around the wrapper
    assert opt.optimizer is tr.optimizers[0]  # LightningOptimizer.optimizer: the object it wraps
    assert tr.optimizers[0].step_count == 8 == model.training_step_calls
    assert torch.equal(params_of(model), params_of(plain))
    assert "optstate/state_mb_device" in tr.callback_metrics
    # compressed state in manual mode
    model = Regressor(manual=True)
    tr = trainer(callbacks=[OptStateCallback(policy="8bit")], max_epochs=2)
    tr.fit(model, loader())
    assert tr.callback_metrics["optstate/bits_per_param"] < 32
    assert sum(model.losses[-4:]) < 0.5 * sum(model.losses[:4])


def test_two_optimizers_manual_optimization():
    class TwoOpts(Regressor):
        def training_step(self, batch, batch_idx):
            x, y = batch
            for opt in self.optimizers():
                opt.zero_grad()
                loss = torch.nn.functional.mse_loss(self(x), y)
                self.manual_backward(loss)
                opt.step()
            self.losses.append(float(loss.detach()))
            return loss

        def configure_optimizers(self):
            first, rest = list(self.net[0].parameters()), list(self.net[1:].parameters())
            return torch.optim.AdamW(first, lr=1e-2), torch.optim.SGD(rest, lr=1e-3, momentum=0.9)

    model = TwoOpts(manual=True)
    tr = trainer(callbacks=[OptStateCallback(policy="8bit")], max_epochs=1)
    tr.fit(model, loader())
    assert [type(o.optimizer).__name__ for o in tr.optimizers] == ["AdamW", "SGD"]
    assert [o.step_count for o in tr.optimizers] == [8, 8]
    assert tr.optimizers[0].policy is not tr.optimizers[1].policy  # one policy copy per optimizer
    for i in (0, 1):
        assert f"optstate/{i}/bits_per_param" in tr.callback_metrics


def test_lightning_optimizer_shell_gets_no_attribute_writes():
    """LightningOptimizer rebinds __class__ around the wrapper without running its __init__:
    every VirtualOptimizer method called on the shell must act on the wrapped object."""
    from lightning.pytorch.core.optimizer import LightningOptimizer

    model = Regressor()
    vo = oc.wrap(torch.optim.AdamW(model.parameters(), lr=1e-2), "8bit")
    shell = LightningOptimizer(vo)
    before = set(shell.__dict__)
    x, y = regression_data(8)[:]
    torch.nn.functional.mse_loss(model(x), y).backward()
    vo.step()
    shell.set_step_boundary(False)
    shell.bind_step_boundary(None)
    shell.observe_loss(1.0)
    sd = shell.state_dict()
    shell.load_state_dict(sd)
    shell.zero_grad()
    shell.memory_report()
    shell.log_metrics()
    shell.train()
    shell.eval()
    shell.get_state(next(model.parameters()))
    shell.register_step_post_hook(lambda *a: None)
    assert set(shell.__dict__) == before
    assert shell.param_groups is vo.param_groups and shell.state is vo.state
    assert shell.step_count == vo.step_count == 1


# -- metrics ----------------------------------------------------------------------------------------
def test_metrics_logged_on_steps():
    class Record(Regressor):
        def on_train_batch_end(self, outputs, batch, batch_idx):
            super().on_train_batch_end(outputs, batch, batch_idx)
            self.seen = getattr(self, "seen", [])
            self.seen.append(float(self.trainer.callback_metrics.get("optstate/step_ms", float("nan"))))

    model = Record()
    tr = trainer(callbacks=[OptStateCallback(policy="8bit")], accumulate_grad_batches=4, max_epochs=1)
    tr.fit(model, loader())
    m = {k: float(v) for k, v in tr.callback_metrics.items()}
    report = tr.optimizers[0].memory_report()
    assert m["optstate/state_mb_device"] == pytest.approx(report["device_bytes"] / 2 ** 20)
    assert m["optstate/bits_per_param"] == pytest.approx(report["bits_per_param"]) and m["optstate/bits_per_param"] < 32
    assert m["optstate/compression_active"] == 1.0 and m["optstate/overhead_ms"] >= 0
    # logged only after micro-batches that stepped: nothing before the first step (batch 4)
    assert all(v != v for v in model.seen[:3]) and all(v > 0 for v in model.seen[3:])

    tr = trainer(callbacks=[OptStateCallback(log_metrics=False)], max_epochs=1)
    tr.fit(Regressor(), loader())
    assert not [k for k in tr.callback_metrics if k.startswith("optstate/")]


# -- AdaptiveWarmupPolicy ---------------------------------------------------------------------------
def test_adaptive_policy_gets_window_mean_loss():
    template = oc.AdaptiveWarmupPolicy(warmup_steps=1000, patience=2, tol=0.2, momentum_codec="int8",
                                       variance_codec="int8")
    model, cb = Regressor(lr=3e-2), OptStateCallback(policy=template)
    tr = trainer(callbacks=[cb], accumulate_grad_batches=2, max_epochs=6)
    tr.fit(model, loader())
    opt = tr.optimizers[0]
    assert template.switched is False and opt.policy is not template  # the template is never mutated
    # Replay the per-step window means through a fresh policy: it must switch at the same step.
    replay = oc.AdaptiveWarmupPolicy(warmup_steps=1000, patience=2, tol=0.2)
    expected = next(i + 1 for i, loss in enumerate(model.step_losses) if replay.observe_loss(loss))
    assert cb.switch_steps == [expected] and 0 < expected < opt.step_count
    assert opt.policy.switched and tr.callback_metrics["optstate/compression_active"] == 1.0


# -- strategies by name -----------------------------------------------------------------------------
def test_name_rules_see_module_parameter_names():
    policy = oc.make_policy("8bit", min_int8_elements=0, whole_blocks_1d=False, rules={r"^net\.0\.": "fp32"})
    tr = trainer(callbacks=[OptStateCallback(policy=policy)])
    model = Regressor()
    tr.fit(model, loader())
    state = tr.optimizers[0].state
    first, middle = model.net[0].weight, model.net[2].weight
    assert not isinstance(state[first]["exp_avg"], oc.EncodedTensor)
    assert isinstance(state[middle]["exp_avg"], oc.EncodedTensor)


def test_strategy_by_string_wraps_and_adds_callback(tmp_path):
    model = Regressor()
    tr = trainer(strategy="optstate", accumulate_grad_batches=2, enable_checkpointing=True,
                 default_root_dir=tmp_path)
    assert isinstance(tr.strategy, OptStateSingleDeviceStrategy) and tr.strategy.root_device.type == "cpu"
    tr.fit(model, loader())
    opt = tr.optimizers[0]
    assert isinstance(opt, oc.VirtualOptimizer) and opt.step_count == 4
    names = [type(c).__name__ for c in tr.callbacks]
    assert names.count("OptStateCallback") == 1
    # the added callback feeds the policy before ModelCheckpoint saves in on_train_batch_end
    assert names.index("OptStateCallback") < names.index("ModelCheckpoint")
    assert "optstate/bits_per_param" in tr.callback_metrics

    tr = trainer(strategy=OptStateSingleDeviceStrategy(policy="4bit", wrap_options={"chunk_bytes": "1MB"}))
    tr.fit(Regressor(), loader())
    codecs = {v.codec.name for st in tr.optimizers[0].state.values() for v in st.values()
              if isinstance(v, oc.EncodedTensor)}
    assert codecs and all("4" in name for name in codecs), codecs
    # a user's OptStateCallback takes precedence over the strategy's own settings
    cb = OptStateCallback(policy="fp32")
    tr = trainer(strategy="optstate_single_device", callbacks=[cb])
    tr.fit(Regressor(), loader())
    assert cb.optimizers == tr.optimizers and not any(
        isinstance(v, oc.EncodedTensor) for st in tr.optimizers[0].state.values() for v in st.values())


def test_single_device_strategy_refuses_several_devices():
    with pytest.raises(ValueError, match="devices"):
        trainer(strategy="optstate", devices=2)


# -- bad inputs -------------------------------------------------------------------------------------
def test_bad_arguments_raise_value_error():
    with pytest.raises(ValueError, match="policy"):
        OptStateCallback(policy=3)
    with pytest.raises(ValueError, match="preset"):
        OptStateCallback(policy="9bit")
    with pytest.raises(ValueError, match="chunk_bytes"):
        OptStateCallback(chunk_bytes="lots")
    with pytest.raises(ValueError, match="wrap options"):
        OptStateCallback(not_an_option=1)
    with pytest.raises(ValueError, match="log_metrics"):
        OptStateCallback(log_metrics="yes")
    with pytest.raises(ValueError, match="wrap_options"):
        OptStateSingleDeviceStrategy(wrap_options=["chunk_bytes"])
    tr = trainer(callbacks=[OptStateCallback(), OptStateCallback()])
    with pytest.raises(ValueError, match="more than one OptStateCallback"):
        tr.fit(Regressor(), loader())


# -- the pytorch_lightning package ------------------------------------------------------------------
def test_pytorch_lightning_package():
    pl = pytest.importorskip("pytorch_lightning")
    from optstate_lightning import pl as opl

    class PLRegressor(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Linear(32, 4)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    kw = dict(accelerator="cpu", max_epochs=1, logger=False, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False)
    for extra in ({"callbacks": [opl.OptStateCallback(policy="8bit", )]}, {"strategy": "optstate"}):
        tr = pl.Trainer(accumulate_grad_batches=2, **kw, **extra)
        tr.fit(PLRegressor(), loader())
        assert isinstance(tr.optimizers[0], oc.VirtualOptimizer) and tr.optimizers[0].step_count == 4
        assert "optstate/bits_per_param" in tr.callback_metrics
    assert isinstance(tr.strategy, opl.OptStateSingleDeviceStrategy)
    assert isinstance(tr.strategy, pl.strategies.SingleDeviceStrategy)
    assert not issubclass(opl.OptStateCallback, __import__("lightning").pytorch.Callback)
