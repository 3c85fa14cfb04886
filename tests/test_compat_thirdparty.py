"""``optstate compat --thirdparty``: discovery of the third-party optimizers (each with a factory or a reason
to skip it), the runner on a few of them (schedule-free train()/eval(), refusals, fp32 bit-identity) and
the markdown page. Cheap: tiny step counts, one seed."""
import argparse

import pytest
import torch

from optstate_core.apps import compat, thirdparty


def entries(*names):
    return thirdparty.discover(list(names))


def test_every_discovered_entry_has_a_factory_or_a_reason():
    pytest.importorskip("pytorch_optimizer")
    found = thirdparty.discover()
    names = [e.name for e in found]
    assert len(names) == len(set(names))
    for e in found:
        assert ":" in e.name and e.name.split(":")[0] in thirdparty.PACKAGES
        assert (e.factory is None) != (e.skip is None), e.name
        if e.skip is not None:
            assert e.skip.strip(), e.name
    by_name = {e.name: e for e in found}
    assert "closure" in by_name["pytorch_optimizer:AliG"].skip
    assert "create_graph" in by_name["pytorch_optimizer:AdaHessian"].skip
    assert "torch.optim.Adam" in by_name["pytorch_optimizer:Adam"].skip
    assert by_name["pytorch_optimizer:Lamb"].factory is not None


@pytest.mark.parametrize("module,name", [("schedulefree", "schedulefree:AdamWScheduleFree"),
                                         ("schedulefree", "schedulefree:SGDScheduleFree"),
                                         ("prodigyopt", "prodigyopt:Prodigy"), ("lion_pytorch", "lion_pytorch:Lion"),
                                         ("came_pytorch", "came_pytorch:CAME"), ("optimi", "optimi:AdamW"),
                                         ("heavyball", "heavyball:AdamW"), ("adam_mini", "adam_mini:Adam_mini")])
def test_package_classes_are_discovered_and_build(module, name):
    pytest.importorskip(module)
    (e,) = entries(name)
    assert e.skip is None and e.factory is not None
    model, _, _, _ = compat.task(0, bias=e.bias)
    assert isinstance(e.factory(model), torch.optim.Optimizer)


def test_an_unknown_name_is_refused_with_the_known_ones():
    pytest.importorskip("schedulefree")
    with pytest.raises(ValueError, match="schedulefree:AdamWScheduleFree"):
        thirdparty.discover(["schedulefree:NoSuchOptimizer"])


def test_not_training_names_the_seed():
    assert thirdparty.not_training([0.4, 0.4], [0.1, 0.2]) is None
    assert "seed 1" in thirdparty.not_training([0.4, 0.4], [0.1, 0.39])
    assert "nan" in thirdparty.not_training([0.4], [float("nan")])


def test_schedule_free_runs_switch_train_and_eval(monkeypatch):
    """The runner puts a schedule-free optimizer in train mode for the steps and in eval mode for the
    held-out loss, wrapped (through the wrapper) or not."""
    schedulefree = pytest.importorskip("schedulefree")
    calls = []
    real_train, real_eval = schedulefree.AdamWScheduleFree.train, schedulefree.AdamWScheduleFree.eval
    monkeypatch.setattr(schedulefree.AdamWScheduleFree, "train", lambda self: (calls.append("train"), real_train(self)))
    monkeypatch.setattr(schedulefree.AdamWScheduleFree, "eval", lambda self: (calls.append("eval"), real_eval(self)))
    (e,) = entries("schedulefree:AdamWScheduleFree")
    for preset in (None, "8bit"):
        calls.clear()
        run = compat.run_one(e.name, preset, 0, 3, factory=e.factory, bias=e.bias)
        assert calls == ["train", "eval"], preset
        assert run.loss < run.initial * 1.5 and torch.isfinite(torch.tensor(run.loss))


def test_runner_rows_skips_and_exactness():
    """Two runnable optimizers and a skipped one: rows per preset with gaps and bits, fp32 exactness on
    the fp32 row only, the skipped one with its reason and no rows."""
    pytest.importorskip("optimi")
    pytest.importorskip("pytorch_optimizer")
    found = entries("optimi:Lion", "pytorch_optimizer:Tiger", "pytorch_optimizer:AdaHessian")
    thirdparty.TRAINS, old = 10.0, thirdparty.TRAINS  # a few steps need not train the task
    try:
        table = compat.thirdparty_rows(found, ["fp32", "8bit"], seeds=1, steps=3)
    finally:
        thirdparty.TRAINS = old
    assert table["pytorch_optimizer:AdaHessian"]["skip"] and not table["pytorch_optimizer:AdaHessian"]["rows"]
    for name in ("optimi:Lion", "pytorch_optimizer:Tiger"):
        entry = table[name]
        assert entry["skip"] is None and len(entry["base"]) == 1
        fp32, eight = entry["rows"]
        assert fp32.exact in (True, False) and eight.exact is None
        assert eight.reason is None and len(eight.gaps) == 1 and eight.bits_per_param < fp32.bits_per_param
    assert table["optimi:Lion"]["rows"][0].exact is True  # Lion keeps one plain momentum: wrapped fp32 is exact


def test_a_non_training_optimizer_is_skipped_with_its_losses():
    pytest.importorskip("pytorch_optimizer")
    (e,) = entries("pytorch_optimizer:Lamb")
    table = compat.thirdparty_rows([e], ["fp32"], seeds=1, steps=1)
    assert "does not train the task unwrapped" in table["pytorch_optimizer:Lamb"]["skip"]


def test_markdown_page_has_rows_exactness_recommendations_and_versions():
    pytest.importorskip("optimi")
    pytest.importorskip("pytorch_optimizer")
    found = entries("optimi:Lion", "pytorch_optimizer:AliG")
    thirdparty.TRAINS, old = 10.0, thirdparty.TRAINS
    try:
        table = compat.thirdparty_rows(found, ["fp32", "4bit"], seeds=1, steps=2)
    finally:
        thirdparty.TRAINS = old
    text = compat.thirdparty_markdown(table, 1, 2, compat.THIRDPARTY_HEADER, thirdparty.versions())
    assert text.startswith("# Compatibility: third-party optimizers")
    assert "| fp32 exact | verdict |" in text
    assert "| optimi:Lion | `fp32` | yes | 32.0 |" in text and "| exact | holds |" in text
    assert "| optimi:Lion | `4bit` | yes |" in text
    assert "| pytorch_optimizer:AliG | | skipped: needs a closure" in text
    assert "- optimi:Lion (lr=0.001): " in text and "- pytorch_optimizer:AliG: skipped (" in text
    assert "torch-optimi " + thirdparty.versions()["torch-optimi"] in text
    for line in text.splitlines():
        if line.startswith("| ") and "---" not in line:
            assert line.count("|") == 9, line  # 8 columns


def test_cli_writes_the_page_and_keeps_torch_names_apart(tmp_path, capsys):
    pytest.importorskip("optimi")
    p = argparse.ArgumentParser()
    compat.add_arguments(p)
    out = tmp_path / "tp.md"
    args = p.parse_args(["--thirdparty", "--optimizers", "optimi:Lion,pytorch_optimizer:AdaHessian", "--steps", "2",
                         "--seeds", "1", "--presets", "fp32", "--out", str(out)])
    thirdparty.TRAINS, old = 10.0, thirdparty.TRAINS
    try:
        assert compat.run(args) == 0
    finally:
        thirdparty.TRAINS = old
    text = out.read_text()
    assert "| optimi:Lion | `fp32` |" in text and "pytorch_optimizer:AdaHessian | | skipped" in text
    with pytest.raises(ValueError, match="add --thirdparty"):
        compat.run(p.parse_args(["--optimizers", "optimi:Lion"]))
    assert p.parse_args([]).presets is None and not p.parse_args([]).thirdparty
