"""tools/first_use_probe.py on the CPU: one row with every first use and its second, the warm start
timed apart when asked, and bad arguments refused by name (the GPU figures are in docs/benchmarks-journal.md 38)."""
import json

import pytest

from helpers import load_tool

tool = load_tool("first_use_probe")
TINY = ["--seq", "16", "--heads", "4", "--kv-heads", "2", "--head-dim", "8"]
USES = ("matmul", "attention", "triton_compile", "triton_launch")


def test_a_row_times_each_first_use_and_its_second(tmp_path):
    out = tmp_path / "rows.jsonl"
    row = tool.main([*TINY, "--warm-start", "--json", str(out)])
    for use in USES:
        assert row[use] >= 0 and row[use + "_again"] >= 0
    assert row["import_torch"] >= 0 and row["process_s"] >= row["import_torch"]
    assert row["warm_start"] is None  # CPU: nothing to warm
    saved = json.loads(out.read_text())
    assert saved["device"] == "cpu" and set(USES) <= set(saved)


@pytest.mark.parametrize("argv, name", [
    (["--seq", "0"], "--seq"),
    (["--head-dim", "-2"], "--head-dim"),
    (["--heads", "6", "--kv-heads", "4"], "--heads"),
])
def test_bad_arguments_are_refused_by_name(capsys, argv, name):
    with pytest.raises(SystemExit) as e:
        tool.parse_args(argv)
    assert e.value.code == 2 and name in capsys.readouterr().err
