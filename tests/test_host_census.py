"""tools/host_census.py: a census of the tiny example on the CPU (the 8B census needs a GPU)."""
import torch

from helpers import load_tool


def test_census_counts_one_gradient_hook_per_parameter_per_step_and_unpatches(tmp_path):
    from optstate_core.apps.llama import NAMED_SHAPES, build_model
    from optstate_core.schedule.release import ClipAndRelease

    tool = load_tool("host_census")
    flush = ClipAndRelease.flush
    out = tmp_path / "census.txt"
    lines = tool.main(["--out", str(out), "--", "--shape", "tiny", "--steps", "4", "--seq", "32",
                       "--preset", "bf16w-4bit-lean-offload"])
    assert ClipAndRelease.flush is flush  # the wrappers are gone
    assert out.read_text().splitlines() == lines
    assert lines[0].startswith("2 steps, ")
    rows = {line.split()[0]: [float(x) for x in line.split()[1:]] for line in lines[2:]}
    n_params = len(list(build_model(NAMED_SHAPES["tiny"], torch.device("cpu"), torch.bfloat16).parameters()))
    assert rows["timetable.gradient_ready"][0] == n_params  # every parameter's hook, once a step
    assert rows["release.flush"][0] >= 1 and rows["release.flush"][1] > 0


def test_census_table_needs_a_step_after_the_warm_up():
    census = load_tool("host_census").Census()
    census.snapshot(end=False)
    census.snapshot(end=True)
    assert census.table(skip=2)[0].startswith("no steps")
