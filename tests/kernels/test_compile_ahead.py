"""Kernel variants compiled ahead (step/kernels/compile_ahead.py): what wrap() and a first step
queue must be the variants the next launches use. The suite runs the kernels interpreted, where
nothing is compiled: the worker's compile is replaced by a recorder and the switch forced on."""
import pytest
import torch

import optstate_core as oc
from optstate_core.step.kernels import compile_ahead

from helpers import mlp, train_steps

pytest.importorskip("triton")


@pytest.fixture
def recorded(monkeypatch):
    """Compiling ahead on (interpreted), the worker recording instead of compiling; launches
    record the variant they look up (busy() forced true so each launch looks)."""
    seen = {"submitted": [], "launched": []}
    monkeypatch.setattr(compile_ahead, "_PENDING", {})
    monkeypatch.setattr(compile_ahead, "_ACTIVE", set())
    monkeypatch.setattr(compile_ahead, "enabled", lambda wanted=True: True)
    monkeypatch.setattr(compile_ahead, "_compile", lambda kernel, args, kwargs, device: True)
    monkeypatch.setattr(compile_ahead, "busy", lambda: True)
    submit = compile_ahead.submit

    def recording_submit(key, *a):
        seen["submitted"].append(key)
        return submit(key, *a)

    monkeypatch.setattr(compile_ahead, "submit", recording_submit)
    monkeypatch.setattr(compile_ahead, "wait_for", lambda key: seen["launched"].append(key))
    return seen


def _is_first(key) -> bool:
    return ("FIRST", True) in key[2]


@pytest.mark.parametrize("preset,options", [
    ("8bit", {}),
    ("bf16w-4bit-lean-offload", {"release_gradients": True, "max_grad_norm": 1.0, "release_bucket_bytes": 1}),
], ids=["8bit", "offload+release-per-param"])
def test_twins_queued_by_the_first_step_are_the_second_steps_variants(preset, options, recorded):
    """Every update-kernel variant the second step launches was queued as the twin of a first-step
    launch (and only FIRST=False twins were queued); the step-count kernels wrap() would compile on
    a device are those the first step launched."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # interpreted on the CPU
    model = mlp().to(device)
    if oc.presets.has_master_weights(preset):
        oc.cast_model(model)
    opt = oc.wrap(torch.optim.AdamW(model.parameters(), lr=1e-3), preset, fused=True, staging_bytes="16KB", **options)
    train_steps(model, opt, 1, seed=1)
    first = list(recorded["launched"])
    twins = set(recorded["submitted"])
    updates = [k for k in first if any(name == "FIRST" for name, _ in k[2])]
    assert updates and all(_is_first(k) for k in updates)
    assert twins and not any(_is_first(k) for k in twins)
    recorded["launched"].clear()
    train_steps(model, opt, 1, seed=2)
    second = [k for k in recorded["launched"] if any(name == "FIRST" for name, _ in k[2])]
    assert second and set(second) <= twins
    step_counts = {k for k in first if k not in updates}
    ahead = {compile_ahead.variant_key(*v) for v in compile_ahead.first_step_variants(opt._engine.inner, device)}
    assert step_counts and step_counts <= ahead


def test_the_switch_is_checked_by_name(monkeypatch):
    """``OPTSTATE_COMPILE_AHEAD`` is the default of ``tuning.compile_ahead``: a bad value fails wrap()
    by name; the option wins over it; under ``TRITON_INTERPRET=1`` nothing is compiled ahead."""
    from optstate_core.tuning import Tuning
    with pytest.raises(ValueError, match="OPTSTATE_COMPILE_AHEAD"):
        Tuning.from_env({"OPTSTATE_COMPILE_AHEAD": "yes"})
    assert not Tuning.from_env({"OPTSTATE_COMPILE_AHEAD": "0"}).compile_ahead
    monkeypatch.setenv("OPTSTATE_COMPILE_AHEAD", "0")
    assert Tuning.resolve({"compile_ahead": True}).compile_ahead
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert compile_ahead.enabled(True) and not compile_ahead.enabled(False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not compile_ahead.enabled(True)  # interpreted: nothing to compile


def test_a_launch_over_one_tensor_is_the_variant_of_a_launch_over_several():
    """The update kernels do not specialize on their tensor count (gradient release launches one
    parameter at a time, buckets several: one compile serves both); an integer argument a kernel
    does specialize still splits variants at 1, as Triton does."""
    from optstate_core.step.kernels.adam import adam_kernel
    from optstate_core.step.kernels.lion import lion_kernel
    from optstate_core.step.kernels.schedule_free import schedule_free_adamw_kernel
    from optstate_core.step.kernels.sgd import sgd_kernel

    for kernel in (adam_kernel, sgd_kernel, lion_kernel, schedule_free_adamw_kernel):
        assert compile_ahead.unspecialized(kernel) == {"N_TENSORS"}, kernel
    names = adam_kernel.arg_names
    table = torch.zeros(4, dtype=torch.int64)

    def key(kernel, n):
        args = tuple(n if name == "N_TENSORS" else 16 if name == "TPOW2" else table for name in names[:20])
        return compile_ahead.variant_key(kernel, args, {"FIRST": True})

    assert key(adam_kernel, 1) == key(adam_kernel, 3) == key(adam_kernel, 40)
    assert key(adam_kernel, 1) != key(adam_kernel, 2**40)  # a 64-bit count is another signature

    class Specializing:  # a kernel that specializes every integer (Triton's default)
        arg_names = adam_kernel.arg_names
        do_not_specialize = ()

    assert key(Specializing, 3) == key(Specializing, 5) != key(Specializing, 1) != key(Specializing, 32)


class _Compiled:
    """A compiled variant as Triton returns it: ``_init_handles`` loads it (and builds its launcher)."""

    def __init__(self, fail=False):
        self.loaded, self.fail = 0, fail

    def _init_handles(self):
        if self.fail:
            raise RuntimeError("launcher build failed")
        self.loaded += 1


class _Kernel:
    __name__ = "fake_kernel"

    def __init__(self, compiled):
        self.compiled, self.calls = compiled, []

    def warmup(self, *args, grid, **kwargs):
        self.calls.append((args, grid, kwargs))
        return self.compiled


@pytest.mark.parametrize("compiled", [_Compiled(), object()], ids=["triton-3.6", "without-init-handles"])
def test_the_worker_loads_what_it_compiles(monkeypatch, compiled):
    """The worker compiles a variant and loads it (module and launcher), so that its first launch
    on the training thread does neither; a Triton without ``_init_handles`` is only compiled."""
    monkeypatch.setattr(compile_ahead, "_STATS", dict(compile_ahead._STATS, compiled=0, failed=0))
    kernel = _Kernel(compiled)
    assert compile_ahead._compile(kernel, (1, 2), {"FIRST": False}, torch.device("cpu")) is True
    assert kernel.calls == [((1, 2), (1,), {"FIRST": False})]
    assert getattr(compiled, "loaded", 1) == 1
    assert compile_ahead.stats()["compiled"] == 1 and compile_ahead.stats()["failed"] == 0


def test_a_load_that_fails_is_left_to_the_launch(monkeypatch):
    monkeypatch.setattr(compile_ahead, "_STATS", dict(compile_ahead._STATS, compiled=0, failed=0))
    assert compile_ahead._compile(_Kernel(_Compiled(fail=True)), (), {}, torch.device("cpu")) is False
    assert compile_ahead.stats()["failed"] == 1 and compile_ahead.stats()["compiled"] == 0
