"""tools/attention_backward_probe.py on the CPU: it counts the trials whose gradients differ from the
first, per gradient, and refuses bad arguments by name (the GPU table is in docs/benchmarks-journal.md 37)."""
import pytest
import torch

from helpers import load_tool

tool = load_tool("attention_backward_probe")
TINY = ["--trials", "3", "--seq", "16", "--heads", "4", "--kv-heads", "2", "--head-dim", "8", "--device", "cpu"]


def test_math_backend_on_the_cpu_repeats_bit_for_bit():
    rows = tool.main([*TINY, "--backends", "math"])
    assert [r["mode"] for r in rows] == list(tool.MODES)
    for r in rows:
        assert "error" not in r and r["trials"] == 3
        assert (r["dq"], r["dk"], r["dv"], r["max_abs"]) == (0, 0, 0, 0.0)
    assert not torch.are_deterministic_algorithms_enabled()  # the deterministic mode is undone


def test_a_differing_gradient_is_counted_with_its_largest_difference(monkeypatch):
    real, calls = tool.backward, []

    def flaky(*a):
        dq, dk, dv = real(*a)
        calls.append(1)
        if len(calls) in (3, 4):  # the 2nd and 3rd trials after the first pass
            dq = dq.clone()
            dq.view(-1)[5] += 0.25 * len(calls)
        return dq, dk, dv
    monkeypatch.setattr(tool, "backward", flaky)
    row = tool.probe(tool.parse_args([*TINY, "--backends", "math"]), "math", "idle", tool.SideWork(0, "cpu"))
    assert (row["trials"], row["dq"], row["dk"], row["dv"]) == (3, 2, 0, 0)
    assert row["max_abs"] == pytest.approx(1.0)


@pytest.mark.parametrize("argv, name", [
    (["--backends", "fast"], "--backends"),
    (["--trials", "0"], "--trials"),
    (["--heads", "6", "--kv-heads", "4"], "--heads"),
    (["--busy-mib", "-1"], "--busy-mib"),
])
def test_bad_arguments_are_refused_by_name(capsys, argv, name):
    with pytest.raises(SystemExit) as e:
        tool.parse_args(argv)
    assert e.value.code == 2 and name in capsys.readouterr().err
