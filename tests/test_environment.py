"""The ``OPTSTATE_*`` environment settings: one table (``apps/env_table.py``) that holds every name
the code uses, docs/environment.md shows and ``optstate env`` prints; its defaults are the code's."""
import ast
import re
from pathlib import Path

import torch

import optstate_core as oc
from optstate_core.apps import cli, env_table

ROOT = Path(__file__).resolve().parents[1]
NAME = re.compile(r"OPTSTATE_[A-Z0-9_]*")
KNOBS = {k.name: k for k in env_table.KNOBS}


def _code_names() -> dict:
    """Every ``OPTSTATE_*`` token in the package, the integrations, the examples, the tools and the
    install scripts (not the tests), and the files it is in."""
    files = [ROOT / "quickstart.py", ROOT / ".ci" / "run"]
    for top in ("optstate_core", "integrations", "examples", "tools"):
        files += [p for p in (ROOT / top).rglob("*") if p.suffix in (".py", ".sh")]
    found = {}
    for path in files:
        if path.name == "env_table.py":
            continue
        for name in NAME.findall(path.read_text()):
            found.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    return found


def test_every_name_in_the_code_is_in_the_table_and_the_doc():
    """A new setting cannot go undocumented: each name the code mentions is a knob of the table (a
    name ending in ``_`` is a family: some knob starts with it), or one of the few that are not
    settings; every knob is still in the code; docs/environment.md holds the table as printed."""
    found = _code_names()
    for name, where in found.items():
        if name.endswith("_"):
            assert any(k.startswith(name) for k in KNOBS), (name, where)
        else:
            assert name in KNOBS or name in env_table.NOT_SETTINGS, f"{name} ({sorted(where)}) is not in env_table.KNOBS"
    assert not set(KNOBS) - set(found), "knobs no code reads"
    for knob in env_table.KNOBS:
        assert knob.kind in ("user", "diagnosis"), knob
        where = knob.where.split(", ")
        assert all((ROOT / w).exists() for w in where), knob
        assert set(where) <= found[knob.name], (knob.name, found[knob.name])  # the file said reads it
    assert env_table.markdown() in (ROOT / "docs" / "environment.md").read_text(), \
        "docs/environment.md's table differs: paste `optstate env --markdown`"


def test_the_defaults_are_the_codes(monkeypatch):
    """Each knob's default is the default of its ``tuning`` field (``Tuning.from_env`` of an empty
    environment, the one reader of these variables) and of ``fast_math``."""
    from optstate_core.schedule import prefetch, release
    from optstate_core.state import pinned
    from optstate_core.step import cpu_step
    from optstate_core.tuning import CPU_COMPILE_ENV, Tuning, fast_math_default
    default = {name: k.default for name, k in KNOBS.items()}
    tuning = Tuning.from_env({})
    assert CPU_COMPILE_ENV[default["OPTSTATE_CPU_COMPILE"]] == tuning.cpu_compile == "auto"
    assert float(default["OPTSTATE_CPU_COMPILE_AFTER"]) == tuning.cpu_compile_after_s == cpu_step.DEFAULT_COMPILE_AFTER
    assert int(default["OPTSTATE_CPU_BATCH"]) == tuning.cpu_batch == cpu_step.DEFAULT_BATCH
    assert default["OPTSTATE_CPU_FAST"] == "1" and tuning.cpu_fast_path
    assert int(default["OPTSTATE_STAGE_AHEAD"]) == tuning.stage_ahead == release.DEFAULT_STAGE_AHEAD
    assert int(default["OPTSTATE_PINNED_SLAB_BYTES"]) == tuning.pinned_slab_bytes == pinned.DEFAULT_SLAB_BYTES
    assert default["OPTSTATE_PIN_AHEAD"] == "1" and tuning.pin_ahead
    assert default["OPTSTATE_COMPILE_AHEAD"] == "1" and tuning.compile_ahead
    assert int(default["OPTSTATE_SLAB_MB"]) << 20 == tuning.prefetch_slab_bytes == prefetch.SLAB_BYTES
    assert default["OPTSTATE_FAST_MATH"] == "1" and fast_math_default({})
    # the launch shapes as written in the source (the suite's conftest overrides two of them)
    tree = ast.parse((ROOT / "optstate_core/step/fused_launch.py").read_text())
    shapes = next(ast.literal_eval(n.value) for n in tree.body
                  if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", None) == "LAUNCH_SHAPES")
    for i, name in enumerate(("OPTSTATE_NBLK", "OPTSTATE_NUM_WARPS", "OPTSTATE_ITERS", "OPTSTATE_MAXNREG")):
        assert default[name] == "/".join(str(shapes[kind][i]) for kind in ("int8", "int4", "other")), name
    import optstate_hf_names
    assert default[optstate_hf_names.ENV] == "1" and optstate_hf_names.enabled({})
    assert not optstate_hf_names.enabled({optstate_hf_names.ENV: "0"})
    quickstart = (ROOT / "quickstart.py").read_text()
    assert f'os.environ.get("OPTSTATE_TORCH", "{default["OPTSTATE_TORCH"]}")' in quickstart
    assert 'os.environ.get("OPTSTATE_VENV", ROOT / ".venv")' in quickstart and default["OPTSTATE_VENV"] == "./.venv"


def test_optstate_env_prints_each_knob_with_its_value_and_default(monkeypatch, capsys):
    for name in KNOBS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OPTSTATE_CPU_BATCH", "4")
    assert cli.main(["env"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["name", "value", "default", "kind", "read"]
    rows = {line.split()[0]: line.split() for line in lines[1:len(KNOBS) + 1]}
    assert list(rows) == list(KNOBS)
    for name, row in rows.items():
        assert row[1:4] == ["4" if name == "OPTSTATE_CPU_BATCH" else "-", KNOBS[name].default, KNOBS[name].kind]
    assert cli.main(["env", "--markdown"]) == 0
    assert capsys.readouterr().out == env_table.markdown()


def test_settings_once_read_at_import_are_read_at_wrap(monkeypatch):
    """``OPTSTATE_FAST_MATH``, the launch shapes (and ``OPTSTATE_SLAB_MB``: tests/test_schedule_prefetch.py)
    apply to optimizers wrapped after they are set, without a new import."""
    params = [torch.nn.Parameter(torch.zeros(4, 4))]
    monkeypatch.setenv("OPTSTATE_FAST_MATH", "0")
    opt = oc.wrap(torch.optim.AdamW(params), "8bit")
    assert not opt._engine.kernels.fast_math and opt.memory_report()["options"]["fast_math"] is False
    assert oc.wrap(torch.optim.AdamW(params), "8bit", fast_math=True)._engine.kernels.fast_math  # the option wins
    monkeypatch.delenv("OPTSTATE_FAST_MATH")
    assert oc.wrap(torch.optim.AdamW(params), "8bit").options.fast_math is True
    from optstate_core.step import fused_launch
    from optstate_core.tuning import SHAPE_ENV
    for name in SHAPE_ENV:
        monkeypatch.delenv(name, raising=False)
    assert oc.wrap(torch.optim.AdamW(params), "8bit")._engine.kernels.shapes == fused_launch.LAUNCH_SHAPES
    monkeypatch.setenv("OPTSTATE_MAXNREG", "32")
    shapes = oc.wrap(torch.optim.AdamW(params), "8bit")._engine.kernels.shapes
    assert shapes == {kind: shape[:3] + (32,) for kind, shape in fused_launch.LAUNCH_SHAPES.items()}
