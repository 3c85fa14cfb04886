"""examples/finetune_8b_24gb.py: each framework trains a tiny Llama on CPU with the recipe
(bf16 weights, checkpointing, chunked loss, gradient release), the peers' baseline runs, and bad
arguments are refused by name; on a GPU, a 0.95B model trains under a 12 GB cap, and its
``--deterministic`` runs repeat bit for bit."""
import gc
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "finetune_8b_24gb.py"
TINY = ["--shape", "tiny", "--seq", "32", "--steps", "3", "--micro-batch", "2", "--lr", "1e-3"]


def run_script(tmp_path, argv, timeout=120, lines=1):
    out = tmp_path / "rows.jsonl"
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'integrations'}", OMP_NUM_THREADS="1",
               FINETUNE_OUT=str(tmp_path / "trainer_out"))
    proc = subprocess.run([sys.executable, str(SCRIPT), *argv, "--json", str(out)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == lines
    assert any(line.startswith("| ") for line in proc.stdout.splitlines())
    return rows[0] if lines == 1 else rows


def load_module():
    spec = importlib.util.spec_from_file_location("finetune_8b_24gb", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("framework", ["trainer", "lightning", "accelerate"])
def test_each_framework_trains_with_the_offload_preset(tmp_path, framework):
    if framework == "lightning":
        pytest.importorskip("lightning")
    if framework == "accelerate":
        pytest.importorskip("accelerate")
    deterministic = ["--deterministic"] if framework == "accelerate" else []  # (no framework of its own)
    row = run_script(tmp_path, ["--framework", framework, "--preset", "bf16w-4bit-lean-offload", *TINY,
                                *deterministic])
    assert row["deterministic"] is bool(deterministic)  # read from torch during the run
    assert (row["framework"], row["optimizer"], row["preset"]) == (framework, "optstate", "bf16w-4bit-lean-offload")
    assert row["steps"] == 3 and row["micro_batch"] == 2
    assert len(row["losses"]) == 3 and all(math.isfinite(x) for x in row["losses"])
    assert row["loss_last"] < row["loss_first"]  # the same batch every step: it is being learned
    assert row["step_s"] > 0 and row["tokens_per_s"] > 0
    assert row["peak_gib"] is None and row["peak_after_first_step_gib"] is None  # CUDA only


def test_resident_preset_and_the_adamw_baseline_agree(tmp_path):
    # both through the Trainer: transformers 4.48 (the oldest allowed) counts num_items_in_batch before the label shift,
    # so its losses are (seq - 1) / seq of Accelerate's for the same batch (HF's own loss does the same)
    ours = run_script(tmp_path, ["--framework", "trainer", "--preset", "bf16w-4bit-lean", *TINY])
    (tmp_path / "rows.jsonl").unlink()
    base = run_script(tmp_path, ["--framework", "trainer", "--optimizer", "adamw", *TINY])
    assert base["optimizer"] == "adamw" and base["preset"] is None and base["steps"] == 3
    assert base["loss_last"] < base["loss_first"]
    assert ours["loss_first"] == pytest.approx(base["loss_first"], rel=1e-3)  # the same model and data
    assert ours["loss_last"] == pytest.approx(base["loss_last"], rel=0.02)


def test_profile_trace_covers_the_two_steps_after_the_warm_up(tmp_path):
    """--profile-trace writes a chrome trace with a "step" range for steps 4 and 5 (after the two
    warm-up steps and the first of the window) and a "forward" range inside each."""
    trace = tmp_path / "trace.json"
    row = run_script(tmp_path, ["--framework", "trainer", *TINY, "--steps", "5", "--profile-trace", str(trace)])
    assert row["steps"] == 5
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"]
    steps = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e["name"] == "step")
    forwards = [e["ts"] for e in events if e["name"] == "forward"]
    assert len(steps) == 2 and len(forwards) == 2
    assert all(any(a <= t <= b for a, b in steps) for t in forwards)


def test_against_resident_alternates_the_runs_in_one_process_and_reports_their_ratio(tmp_path):
    rows = run_script(tmp_path, ["--preset", "bf16w-4bit-lean-offload", "--against-resident", "--repeats", "2",
                                 *TINY], lines=5)
    runs, summary = rows[:4], rows[4]
    assert [(r["role"], r["run"], r["preset"]) for r in runs] == [
        ("recipe", 1, "bf16w-4bit-lean-offload"), ("resident", 1, "bf16w-4bit-lean"),
        ("recipe", 2, "bf16w-4bit-lean-offload"), ("resident", 2, "bf16w-4bit-lean")]
    assert all(r["steps"] == 3 and r["loss_last"] < r["loss_first"] for r in runs)
    # the model is rebuilt from the same seed each run: where the state lives changes no loss
    assert runs[0]["losses"] == runs[2]["losses"] == runs[1]["losses"]
    assert summary["role"] == "summary" and summary["runs"] == 2
    assert summary["recipe_runs_s"] == [runs[0]["step_s"], runs[2]["step_s"]]
    assert summary["resident_s"] == pytest.approx((runs[1]["step_s"] + runs[3]["step_s"]) / 2)
    assert summary["tokens_per_s_vs_resident"] == pytest.approx(summary["resident_s"] / summary["recipe_s"])
    assert summary["first_step_s"] == runs[0]["first_step_s"]
    # the wait from the script's start to the first step's end: the process's first run only
    assert runs[0]["since_start_s"] > runs[0]["first_step_s"] > 0
    assert [r["since_start_s"] for r in runs[1:]] == [None] * 3
    assert all(r["warm_start"] is None for r in runs)  # CPU: nothing to warm


@pytest.mark.parametrize("argv, name", [
    (["--micro-batch", "0"], "--micro-batch"),
    (["--gpu-memory", "24XB"], "--gpu-memory"),
    (["--gpu-budget", "lots"], "--gpu-budget"),
    (["--framework", "foo"], "--framework"),
    (["--optimizer", "deepspeed-offload", "--framework", "lightning"], "--optimizer deepspeed-offload"),
    (["--preset", "9bit"], "--preset"),
    (["--steps", "-1"], "--steps"),
    (["--repeats", "0"], "--repeats"),
    (["--find-micro-batch", "--against-resident"], "--find-micro-batch"),
])
def test_bad_arguments_are_refused_by_name(capsys, argv, name):
    module = load_module()
    with pytest.raises(SystemExit) as e:
        module.main(argv)
    assert e.value.code == 2
    assert name in capsys.readouterr().err


def test_preset_plan_follows_optstate_plan(monkeypatch, capsys):
    """``--preset plan`` (the default) runs what ``optstate plan`` picks for the cap and micro-batch:
    at 8B under 24 GB, bf16w-4bit-lean with the budget the activations leave (smaller at micro-batch
    4); an explicit --gpu-budget keeps that budget; no fit exits naming the option; without a cap on
    the CPU, or under several processes, the offload preset. The given arguments are not changed."""
    from optstate_core.apps.llama import NAMED_SHAPES
    from optstate_core.apps.recipe import preset_for
    module = load_module()
    monkeypatch.setattr(module.torch.cuda, "is_available", lambda: False)
    cfg = NAMED_SHAPES["8b"].hf_config()
    for size in (1, 4):
        args = module.parse_args(["--gpu-memory", "24GB", "--micro-batch", str(size)])
        got = module.resolve_plan(args)
        budget = preset_for(cfg, 24 * 10**9, size)[1]
        assert (got.preset, got.gpu_budget_bytes) == ("bf16w-4bit-lean", budget) and budget > 2**30
        assert got.gpu_budget == f"{budget / 2**30:.2f}GiB" and args.preset == "plan" and args.gpu_budget is None
        assert f"--preset plan: bf16w-4bit-lean + gpu_budget={got.gpu_budget}" in capsys.readouterr().out
    got = module.resolve_plan(module.parse_args(["--gpu-memory", "24GB", "--gpu-budget", "2GiB"]))
    assert (got.preset, got.gpu_budget_bytes) == ("bf16w-4bit-lean", 2**30 * 2)
    with pytest.raises(SystemExit, match="--preset plan: no preset fits 8b at micro-batch 16"):
        module.resolve_plan(module.parse_args(["--gpu-memory", "24GB", "--micro-batch", "16"]))
    assert module.resolve_plan(module.parse_args([])).preset == "bf16w-4bit-lean-offload"  # CPU, no cap
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert module.resolve_plan(module.parse_args(["--gpu-memory", "24GB"])).preset == "bf16w-4bit-lean-offload"
    explicit = module.parse_args(["--preset", "bf16w-4bit-lean-hostcorr", "--gpu-memory", "24GB"])
    assert module.resolve_plan(explicit) is explicit


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_trainer_fits_a_095b_model_under_a_12gb_cap(tmp_path):
    row = run_script(tmp_path, ["--shape", "0.95b", "--micro-batch", "1", "--seq", "1024", "--steps", "4",
                                "--gpu-memory", "12GB", "--preset", "bf16w-4bit-lean-offload"], timeout=600)
    assert row["steps"] == 4
    assert row["peak_gib"] <= 12e9 / 2**30
    assert row["loss_last"] < row["loss_first"]
    assert row["warm_start"]["error"] is None and row["warm_start"]["seconds"] > 0  # CUDA's libraries, warmed
    assert row["since_start_s"] > row["first_step_s"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_deterministic_runs_repeat_bit_for_bit_on_a_gpu(tmp_path):
    """--deterministic: two runs in one process give the same losses bit for bit (without it,
    attention's default backward sums dQ in an order that varies: docs/benchmarks-journal.md 37); the first run
    warm-started, the second not: the warm start changes no bit of training."""
    rows = run_script(tmp_path, ["--shape", "0.95b", "--micro-batch", "1", "--seq", "1024", "--steps", "4",
                                 "--gpu-memory", "12GB", "--repeats", "2", "--deterministic"], timeout=600, lines=3)
    first, second = rows[0], rows[1]
    assert first["deterministic"] and second["deterministic"]
    assert first["warm_start"]["error"] is None and second["warm_start"] is None
    assert len(first["losses"]) == 4 and first["losses"] == second["losses"]


def test_step_timer_times_the_first_step_alone_and_the_rest_as_one_window(monkeypatch):
    module = load_module()
    clock = iter([0.0, 5.0,  # step 1: 5 s
                  5.5, 6.0,  # step 2 (not timed)
                  6.0, 7.0, 7.0, 9.0, 9.5, 12.0])  # steps 3-5: a window from 6.0 to 12.0
    monkeypatch.setattr(module.time, "perf_counter", lambda: next(clock))
    timer = module.StepTimer(steps=5)
    for i in range(5):
        timer.begin()
        timer.end(loss=torch.tensor(float(10 - i)))
    assert timer.first_s == 5.0 and timer.window_s == pytest.approx(2.0) and timer.count == 5
    assert gc.get_freeze_count() > 0  # the setup's objects, frozen at the first step (measure() unfreezes)
    gc.unfreeze()
    assert timer.losses == [10.0, 9.0, 8.0, 7.0, 6.0]
    one = module.StepTimer(steps=1)  # one step: it is both the first and the window
    clock = iter([1.0, 4.0])
    one.begin()
    one.end()
    assert one.first_s == one.window_s == 3.0
