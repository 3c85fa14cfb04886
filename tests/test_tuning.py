"""The ``tuning`` option (optstate_core/tuning.py): implementation knobs as one validated wrap()
option, the ``OPTSTATE_*`` environment as its defaults, read at wrap() and nowhere else."""
import pytest
import torch

import optstate_core as oc
from optstate_core.step import fused_launch
from optstate_core.tuning import SHAPE_ENV, Tuning

KNOB_ENV = ("OPTSTATE_CPU_FAST", "OPTSTATE_CPU_COMPILE", "OPTSTATE_CPU_COMPILE_AFTER", "OPTSTATE_CPU_BATCH",
            "OPTSTATE_PIN_AHEAD", "OPTSTATE_COMPILE_AHEAD", "OPTSTATE_SLAB_MB", "OPTSTATE_PINNED_SLAB_BYTES",
            "OPTSTATE_STAGE_AHEAD") + SHAPE_ENV


@pytest.fixture
def clean_env(monkeypatch):
    for name in KNOB_ENV:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def _params():
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(64, 512) * 0.02), torch.nn.Parameter(torch.randn(512) * 0.02)]


def test_the_environment_gives_the_defaults():
    env = {"OPTSTATE_CPU_FAST": "0", "OPTSTATE_CPU_COMPILE": "1", "OPTSTATE_CPU_COMPILE_AFTER": "2.5",
           "OPTSTATE_CPU_BATCH": "3", "OPTSTATE_PIN_AHEAD": "0", "OPTSTATE_COMPILE_AHEAD": "0",
           "OPTSTATE_SLAB_MB": "8", "OPTSTATE_PINNED_SLAB_BYTES": "0", "OPTSTATE_STAGE_AHEAD": "5",
           "OPTSTATE_NBLK": "8", "OPTSTATE_MAXNREG": "32"}
    t = Tuning.from_env(env)
    assert (t.cpu_fast_path, t.cpu_compile, t.cpu_compile_after_s, t.cpu_batch) == (False, "always", 2.5, 3)
    assert (t.pin_ahead, t.compile_ahead, t.prefetch_slab_bytes, t.pinned_slab_bytes, t.stage_ahead) == \
        (False, False, 8 << 20, 0, 5)
    assert t.launch_shapes == {k: (8, s[1], s[2], 32) for k, s in fused_launch.LAUNCH_SHAPES.items()}
    assert Tuning.from_env({"OPTSTATE_CPU_COMPILE": "0"}).cpu_compile == "never"


def test_wrap_reads_the_environment_and_explicit_fields_win(clean_env):
    clean_env.setenv("OPTSTATE_STAGE_AHEAD", "5")
    clean_env.setenv("OPTSTATE_CPU_BATCH", "4")
    clean_env.setenv("OPTSTATE_NBLK", "8")
    opt = oc.wrap(torch.optim.AdamW(_params()), "8bit")
    assert (opt.options.tuning.stage_ahead, opt.options.tuning.cpu_batch) == (5, 4)
    for given in (Tuning(stage_ahead=0, launch_shapes={"int4": (2, 2, 4, 0)}),
                  {"stage_ahead": 0, "launch_shapes": {"int4": [2, 2, 4, 0]}}):
        opt = oc.wrap(torch.optim.AdamW(_params()), "8bit", tuning=given)
        t = opt.options.tuning
        assert (t.stage_ahead, t.cpu_batch) == (0, 4)  # the given field, the environment's for the rest
        assert t.launch_shapes["int4"] == (2, 2, 4, 0)  # a kind given whole; the others with the environment's NBLK
        assert t.launch_shapes["int8"] == (8,) + fused_launch.LAUNCH_SHAPES["int8"][1:]
    # a built WrapOptions keeps its tuning (the environment is not read again); keywords override field by field
    options = oc.WrapOptions.build(torch.optim.AdamW(_params()), tuning={"stage_ahead": 1})
    clean_env.setenv("OPTSTATE_CPU_BATCH", "7")
    opt = oc.wrap(torch.optim.AdamW(_params()), "8bit", options, tuning={"pinned_slab_bytes": "1MiB"})
    assert (opt.options.tuning.stage_ahead, opt.options.tuning.cpu_batch) == (1, 4)
    assert opt.options.tuning.pinned_slab_bytes == 2**20


def test_memory_report_shows_the_tuning(clean_env):
    opt = oc.wrap(torch.optim.AdamW(_params()), "8bit", tuning=Tuning(cpu_compile="never", prefetch_slab_bytes="32MiB"))
    shown = opt.memory_report()["options"]["tuning"]
    assert shown == Tuning.from_env({}).as_dict() | {"cpu_compile": "never",
                                                                     "prefetch_slab_bytes": 32 << 20}
    assert set(shown) == {"cpu_fast_path", "cpu_compile", "cpu_compile_after_s", "cpu_batch", "pin_ahead",
                          "compile_ahead", "prefetch_slab_bytes", "pinned_slab_bytes", "stage_ahead", "launch_shapes"}


@pytest.mark.parametrize("tuning,error,match", [
    ({"stage_ahed": 1}, TypeError, "stage_ahed"),
    ({"stage_ahead": -1}, ValueError, "tuning.stage_ahead"),
    ({"cpu_compile": "1"}, ValueError, "tuning.cpu_compile"),
    ({"cpu_compile_after_s": float("inf")}, ValueError, "tuning.cpu_compile_after_s"),
    ({"cpu_batch": True}, ValueError, "tuning.cpu_batch"),
    ({"pin_ahead": 1}, ValueError, "tuning.pin_ahead"),
    ({"prefetch_slab_bytes": 0}, ValueError, "tuning.prefetch_slab_bytes"),
    ({"pinned_slab_bytes": "lots"}, ValueError, "tuning.pinned_slab_bytes"),
    ({"launch_shapes": {"int2": (1, 1, 1, 0)}}, ValueError, "int2"),
    ({"launch_shapes": {"int8": (0, 1, 1, 0)}}, ValueError, r"tuning.launch_shapes\['int8'\]"),
    ("fast", ValueError, "tuning must be"),
])
def test_a_bad_field_is_refused_by_name_and_changes_nothing(clean_env, tuning, error, match):
    params = _params()
    inner = torch.optim.AdamW(params, lr=1e-2)
    with pytest.raises(error, match=match):
        oc.wrap(inner, "8bit", tuning=tuning)
    assert not inner.state and inner.param_groups[0]["params"] == params


@pytest.mark.parametrize("name,value", [("OPTSTATE_STAGE_AHEAD", "two"), ("OPTSTATE_SLAB_MB", "0"),
                                        ("OPTSTATE_PIN_AHEAD", "yes"), ("OPTSTATE_CPU_COMPILE_AFTER", "-1"),
                                        ("OPTSTATE_ITERS", "0")])
def test_a_bad_variable_is_refused_by_name_and_changes_nothing(clean_env, name, value):
    params = _params()
    inner = torch.optim.AdamW(params, lr=1e-2)
    clean_env.setenv(name, value)
    with pytest.raises(ValueError, match=name) as failed:
        oc.wrap(inner, "8bit")
    assert repr(value) in str(failed.value)
    assert not inner.state and inner.param_groups[0]["params"] == params
    clean_env.delenv(name)
    params[0].grad, params[1].grad = torch.ones_like(params[0]), torch.ones_like(params[1])
    oc.wrap(inner, "8bit").step()  # the inner optimizer is as it was: it wraps and steps
    assert int(inner.state[params[0]]["step"]) == 1


def test_the_values_reach_the_objects_that_use_them(clean_env):
    """Each field is handed to the collaborator the engine builds (no environment read there)."""
    clean_env.setenv("OPTSTATE_STAGE_AHEAD", "3")
    opt = oc.wrap(torch.optim.AdamW(_params()), "8bit", tuning={
        "stage_ahead": 0, "prefetch_slab_bytes": "8MiB", "pinned_slab_bytes": 0,
        "launch_shapes": {"int8": (2, 4, 1, 0)}, "compile_ahead": False})
    engine = opt._engine
    assert engine.clip_release._ahead == 0
    assert engine.schedule.slab_bytes == 8 << 20
    assert engine.pinned.slab_bytes == 0 and engine.park_buffers.arena.slab_bytes == 0
    assert engine.kernels.shapes["int8"] == (2, 4, 1, 0) and not engine.kernels.compile_ahead


def test_the_cpu_fast_path_option_takes_effect(clean_env):
    """``cpu_fast_path`` decides the path of a CPU Adam step on encoded state: on, its steps after
    the first materialize nothing (one fused decode-update-encode call); off, they go through the
    tiled reference path. The environment says the opposite of the option each time."""
    timings = {}
    for fast in (True, False):
        clean_env.setenv("OPTSTATE_CPU_FAST", "0" if fast else "1")
        params = _params()
        opt = oc.wrap(torch.optim.AdamW(params, lr=1e-2), oc.make_policy("8bit", min_int8_elements=0),
                      tuning={"cpu_fast_path": fast, "cpu_compile": "never"})
        for _ in range(2):
            for p in params:
                p.grad = torch.full_like(p, 1e-3)
            opt.step()
        timings[fast] = opt.last_step_timings["materialize_ms"]
    assert timings[True] == 0 and timings[False] > 0
