"""tools/park_bench.py's smoke run on the CPU (a tiny Llama shape, in this process): a row per
contender and switch with every column, the table's header, the rows appended as JSON lines, and
bad arguments refused by name (the GPU figures come from a run on a GPU)."""
import json

import pytest

from helpers import load_tool

tool = load_tool("park_bench")
SMOKE = ["--device", "cpu", "--shape", "tiny", "--layers", "1", "--cycles", "2", "--biases"]


def test_the_smoke_run_prints_a_row_per_contender_and_switch(tmp_path, capsys):
    out = tmp_path / "rows.jsonl"
    rows = tool.main([*SMOKE, "--presets", "8bit,bf16w-4bit-lean", "--json", str(out)])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "| " + " | ".join(tool.COLUMNS) + " |" and len(lines) == 2 + len(rows)
    assert [(r["method"], r["preset"], r["switch"]) for r in rows] == [
        ("optstate", "8bit", "first"), ("optstate", "8bit", "later"),
        ("optstate", "bf16w-4bit-lean", "first"), ("optstate", "bf16w-4bit-lean", "later"),
        (tool.LOOP, "fp32 (fused AdamW)", "first"), (tool.LOOP, "fp32 (fused AdamW)", "later")]
    for r in rows:
        assert set(tool.COLUMNS) <= set(r) and r["park_s"] > 0 and r["wake_s"] > 0 and r["state_gib"] > 0
        assert r["params"] == rows[0]["params"] and (r["ahead_s"] is not None) == (r["method"] == "optstate")
    assert rows[-1]["state_gib"] > max(rows[0]["state_gib"], rows[2]["state_gib"])  # fp32 AdamW's state is the largest
    assert [json.loads(line) for line in out.read_text().splitlines()] == rows


def test_the_time_box_skips_what_it_cannot_start(capsys):
    rows = tool.main([*SMOKE, "--presets", "8bit", "--no-loop", "--max-seconds", "1e-9"])
    assert rows == [] and "skipped (--max-seconds 1e-09 reached): optstate:8bit" in capsys.readouterr().out


@pytest.mark.parametrize("argv, name", [
    (["--layers", "0"], "--layers"),
    (["--cycles", "1"], "--cycles"),
    (["--presets", "8bit,3bit"], "--presets"),
    (["--shape", "9b"], "--shape"),
    (["--max-seconds", "0"], "--max-seconds"),
])
def test_bad_arguments_are_refused_by_name(capsys, argv, name):
    with pytest.raises(SystemExit) as e:
        tool.parse_args(argv)
    assert e.value.code == 2 and name in capsys.readouterr().err
