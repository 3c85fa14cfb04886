"""OptStateCallback: metrics in the Trainer's logs, warmup switching, accumulation boundaries."""
import pytest
import torch

pytest.importorskip("transformers")

import optstate_core as oc  # noqa: E402
import optstate_hf  # noqa: E402
from hf_testlib import losses, make_trainer, one_thread, tiny_model  # noqa: E402,F401
from transformers import TrainerCallback  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

METRICS = ("optstate/state_mb_device", "optstate/state_mb_host", "optstate/bits_per_param", "optstate/step_ms",
           "optstate/overhead_ms", "optstate/compression_active")


class Reporter(TrainerCallback):
    """Stands in for a report_to integration: records what on_log hands it."""

    def __init__(self):
        self.seen = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.seen.append(dict(logs))


def test_metrics_reach_log_history_and_reporters(tmp_path):
    reporter = Reporter()
    callback = optstate_hf.OptStateCallback()
    # the reporter comes first, as the Trainer's report_to callbacks do
    trainer = make_trainer(tmp_path, callbacks=[reporter, callback], max_steps=3, optim="optstate_adamw_4bit")
    trainer.train()
    train_logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(train_logs) == 3
    opt = optstate_hf.find_virtual_optimizer(trainer.optimizer)
    report = opt.memory_report()
    for entry in train_logs + [r for r in reporter.seen if "loss" in r]:
        assert all(isinstance(entry[k], float) for k in METRICS)
        assert entry["optstate/state_mb_device"] == pytest.approx(report["device_bytes"] / 2**20)
        assert entry["optstate/bits_per_param"] == pytest.approx(report["bits_per_param"])
        assert entry["optstate/bits_per_param"] < 16  # 4-bit moments (+ scales), not fp32's 64
        assert entry["optstate/state_mb_host"] == 0.0
        assert entry["optstate/step_ms"] > 0.0
    assert len([r for r in reporter.seen if "loss" in r]) == 3
    assert trainer.callback_handler.callbacks[0] is callback
    # the final summary log is left alone
    assert not any(k.startswith("optstate/") for k in trainer.state.log_history[-1])


def test_offload_metrics_count_host_bytes(tmp_path):
    trainer = make_trainer(tmp_path, max_steps=2, optim="optstate_adamw_offload")
    trainer.train()
    last = [h for h in trainer.state.log_history if "loss" in h][-1]
    opt = optstate_hf.find_virtual_optimizer(trainer.optimizer)
    # the offload preset keeps every compressed moment in the host tier, also on a CPU-only run
    assert last["optstate/state_mb_host"] == pytest.approx(opt.memory_report()["host_bytes"] / 2**20)
    assert last["optstate/state_mb_host"] > 0
    assert last["optstate/state_mb_device"] == 0.0


def test_adaptive_warmup_switches_on_logged_loss(tmp_path):
    # tol=0.5: no logged loss improves by 50%, so every log after the first is stale; patience 2
    # switches after the 3rd log, long before warmup_steps=100.
    trainer = make_trainer(tmp_path, max_steps=6,
                           optim_args="min_int8_elements=0,warmup_steps=100,adaptive=true,patience=2,tol=0.5")
    trainer.train()
    opt = optstate_hf.find_virtual_optimizer(trainer.optimizer)
    assert isinstance(opt.policy, oc.AdaptiveWarmupPolicy) and opt.policy.switched
    active = [h["optstate/compression_active"] for h in trainer.state.log_history if "loss" in h]
    assert active == [0.0, 0.0, 1.0, 1.0, 1.0, 1.0]
    bits = [h["optstate/bits_per_param"] for h in trainer.state.log_history if "loss" in h]
    assert bits[0] == pytest.approx(64.0) and bits[3] < 20  # fp32 during warmup, int8 after the switch
    assert opt.state_dict()["optstate"]["policy"]["switched"] is True


def test_adaptive_warmup_without_feed_stays_in_warmup(tmp_path):
    trainer = make_trainer(tmp_path, max_steps=4, callbacks=[optstate_hf.OptStateCallback(feed_loss=False)],
                           optim_args="warmup_steps=100,adaptive=true,patience=1,tol=0.5")
    trainer.train()
    assert not optstate_hf.find_virtual_optimizer(trainer.optimizer).policy.switched


class BoundaryRecorder(TrainerCallback):
    """Records the engine's step-boundary flag during every backward (from a gradient hook) and
    a fingerprint of the optimizer state after every micro-batch."""

    def __init__(self):
        self.flags, self.events = [], []

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        self.opt = optstate_hf.find_virtual_optimizer(optimizer)
        param = model.transformer.wte.weight
        param.register_hook(lambda grad: self.flags.append(self.opt.step_boundary))

    def fingerprint(self):
        parts = [self.opt.step_count]
        for st in self.opt.state.values():
            for value in st.values():
                if isinstance(value, oc.EncodedTensor):
                    parts += [float(t.double().sum()) for t in value.payload.values()]
                elif isinstance(value, torch.Tensor):
                    parts.append(float(value.double().sum()))
        return tuple(parts)

    def on_substep_end(self, args, state, control, **kwargs):
        self.events.append(("substep", self.fingerprint()))

    def on_step_end(self, args, state, control, **kwargs):
        self.events.append(("step", self.fingerprint()))


def test_accumulation_boundaries_and_state_only_touched_on_sync_steps(tmp_path):
    recorder = BoundaryRecorder()
    trainer = make_trainer(tmp_path, callbacks=[optstate_hf.OptStateCallback(), recorder], max_steps=3,
                           per_device_train_batch_size=2, gradient_accumulation_steps=4)
    trainer.train()
    assert recorder.flags == [False, False, False, True] * 3
    kinds = [kind for kind, _ in recorder.events]
    assert kinds == ["substep", "substep", "substep", "step"] * 3
    before = (0,)  # step 0, no state yet
    for window in range(3):
        events = recorder.events[4 * window: 4 * window + 4]
        for _, fp in events[:3]:
            assert fp == before  # micro-batches that do not step leave the state untouched
        step_fp = events[3][1]
        assert step_fp != before and step_fp[0] == window + 1
        before = step_fp
    # after training the boundary is no longer bound to the Trainer's gradient state
    assert recorder.opt._engine.boundary.source is None


def test_callback_rejects_a_plain_optimizer(tmp_path):
    trainer = make_trainer(tmp_path, optim="adamw_torch", optim_args=None, max_steps=1)
    with pytest.raises(ValueError, match="not an optstate optimizer"):
        trainer.train()


def test_callback_accepts_a_wrapped_optimizer_passed_in(tmp_path):
    model = tiny_model()
    opt = oc.wrap(torch.optim.AdamW(model.parameters(), lr=1e-3), "8bit")
    trainer = make_trainer(tmp_path, model=model, max_steps=2, trainer_kwargs={"optimizers": (opt, None)})
    trainer.train()
    assert opt.step_count == 2
    assert all("optstate/bits_per_param" in h for h in trainer.state.log_history if "loss" in h)
    assert len(losses(trainer)) == 2
