"""The command line: ``optstate demo``, ``optstate bench [--convergence]``, ``--help``, ``python -m``."""
import argparse
import csv
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from optstate_core.apps import cli, demo

ROOT = Path(__file__).resolve().parents[1]
# the columns the issue asks for, in order
COLUMNS = ["run", "step", "loss", "val_loss", "step_time_ms", "tensor_mem_mb", "materialize_ms", "inner_step_ms",
           "commit_ms", "overhead_ms", "cpu_mem_mb", "gpu_mem_mb", "gpu_peak_mb", "compression_active"]
# d_model 64 so that the weight matrices (>= 4096 elements) are compressed by the presets
TINY = ["--steps", "4", "--batch-size", "2", "--seq-len", "16", "--d-model", "64", "--n-layers", "1",
        "--n-heads", "2", "--eval-every", "2", "--eval-batches", "1", "--warmup-steps", "1", "--max-bytes", "50000",
        "--no-progress", "--device", "cpu"]


def read_csv(path):
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        return reader.fieldnames, list(reader)


def test_demo_writes_csv_png_and_summary(tmp_path, capsys):
    out = tmp_path / "demo"
    assert cli.main(["demo", *TINY, "--presets", "8bit,4bit", "--out", str(out)]) == 0
    printed = capsys.readouterr().out

    columns, rows = read_csv(out / "metrics.csv")
    assert columns == COLUMNS
    runs = ["adamw", "optstate-8bit", "optstate-4bit"]
    assert [r["run"] for r in rows] == [name for name in runs for _ in range(4)]
    assert [int(r["step"]) for r in rows] == [1, 2, 3, 4] * 3
    by_run = {name: [r for r in rows if r["run"] == name] for name in runs}
    for name, rs in by_run.items():
        assert [r["val_loss"] != "" for r in rs] == [False, True, False, True]  # every 2 steps and at the end
        assert all(math.isfinite(float(r["loss"])) and float(r["step_time_ms"]) > 0 for r in rs)
        assert all(float(r["cpu_mem_mb"]) > 10 for r in rs)
        assert all(float(r["gpu_mem_mb"]) == float(r["gpu_peak_mb"]) == 0 for r in rs)  # CPU run
    # same initial weights and first batch in every run: identical loss before the first update
    assert len({r[0]["loss"] for r in by_run.values()}) == 1

    model = demo.TinyLM(64, 1, 2, 16)
    n_params = sum(p.numel() for p in model.parameters())
    adamw_mb = float(by_run["adamw"][-1]["tensor_mem_mb"])
    assert adamw_mb == pytest.approx(2 * 4 * n_params / 2**20, rel=1e-5)  # exp_avg + exp_avg_sq in fp32
    mb = {name: float(rs[-1]["tensor_mem_mb"]) for name, rs in by_run.items()}
    assert mb["optstate-4bit"] < mb["optstate-8bit"] < 0.5 * mb["adamw"]
    for r in by_run["adamw"]:
        assert r["compression_active"] == "False"
        assert float(r["overhead_ms"]) == float(r["materialize_ms"]) == float(r["commit_ms"]) == 0
        assert float(r["inner_step_ms"]) > 0
    for name in runs[1:]:
        for r in by_run[name]:
            assert r["compression_active"] == "True"
            assert float(r["inner_step_ms"]) > 0 and float(r["overhead_ms"]) > 0
        # the first step creates the state through tiles; later ones take the CPU fast path,
        # whose decode-update-encode is one call (counted as inner step)
        first = by_run[name][0]
        assert float(first["materialize_ms"]) > 0 and float(first["commit_ms"]) > 0

    png = (out / "demo.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000

    table = {line.split("|")[1].strip(): line.split("|")[2:-1] for line in printed.splitlines()
             if line.startswith("| ") and not line.startswith("| run")}
    assert set(table) == set(runs)
    assert float(table["adamw"][1]) == pytest.approx(64.0)  # bits/param of fp32 AdamW
    assert float(table["adamw"][3]) == pytest.approx(1.0)  # step time ratio to itself
    assert table["adamw"][5].strip() == "+0.00%"
    assert float(table["optstate-4bit"][1]) < float(table["optstate-8bit"][1]) < 20
    final_val = {name: float(rs[-1]["val_loss"]) for name, rs in by_run.items()}
    gap = 100 * (final_val["optstate-8bit"] - final_val["adamw"]) / final_val["adamw"]
    assert float(table["optstate-8bit"][5].strip().rstrip("%")) == pytest.approx(gap, abs=0.006)
    assert (out / "summary.md").exists()


def test_demo_without_plot_and_presets(tmp_path):
    out = tmp_path / "d"
    assert cli.main(["demo", *TINY, "--steps", "2", "--presets", "", "--no-plot", "--out", str(out)]) == 0
    _, rows = read_csv(out / "metrics.csv")
    assert {r["run"] for r in rows} == {"adamw"}
    assert not (out / "demo.png").exists()


def test_corpus_splits_by_file(tmp_path):
    data = tmp_path / "text"
    data.mkdir()
    names = [f"module_{i}.py" for i in range(40)]
    for i, name in enumerate(names):
        (data / name).write_text(f"# file {i}\n" + "x = 1\n" * 50)
    (data / "notes.txt").write_text("ignored: not a .py file")
    corpus = demo.load_corpus(str(data))
    held_out = [n for n in names if demo.is_held_out(Path(n))]
    assert 0 < len(held_out) < 40 and corpus.n_val_files == len(held_out) and corpus.n_train_files == 40 - len(held_out)
    val_text = bytes(corpus.val.tolist()).decode()
    train_text = bytes(corpus.train.tolist()).decode()
    for i, name in enumerate(names):
        marker = f"# file {i}\n"
        assert (marker in val_text) == (name in held_out) and (marker in train_text) == (name not in held_out)
    assert "ignored" not in train_text + val_text


def test_default_corpus_is_the_standard_library():
    corpus = demo.load_corpus(max_bytes=200_000)
    assert len(corpus.train) == 200_000 and 0 < len(corpus.val) <= 20_000
    assert corpus.n_train_files > 1 and corpus.n_val_files >= 1
    assert Path(corpus.source) == demo.default_text_dir()
    assert b"def " in bytes(corpus.train[:100_000].tolist())


def test_runs_are_reproducible(tmp_path):
    cfg = demo.DemoConfig(steps=3, batch_size=2, seq_len=16, d_model=32, n_layers=1, n_heads=2, eval_every=3,
                          eval_batches=1, warmup_steps=1, max_bytes=30_000)
    corpus = demo.load_corpus(max_bytes=cfg.max_bytes)
    a = demo.train_run("8bit", cfg, corpus, progress=False)
    b = demo.train_run("8bit", cfg, corpus, progress=False)
    assert [r["loss"] for r in a.rows] == [r["loss"] for r in b.rows]
    assert a.final_val_loss == b.final_val_loss


@pytest.mark.parametrize("argv,message", [
    (["demo", "--presets", "9bit"], "--presets"),
    (["demo", "--presets", "8bit,8bit"], "--presets"),
    (["demo", "--d-model", "30", "--n-heads", "4"], "--d-model"),
    (["demo", "--steps", "0"], "--steps"),
    (["demo", "--lr", "-1"], "--lr"),
    (["demo", "--data", "/nonexistent/dir"], "--data"),
    (["bench", "--convergence", "--seeds", "1"], "--seeds"),
])
def test_bad_input_is_a_usage_error(argv, message, capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        cli.main([*argv, "--out", str(tmp_path / "o"), "--no-progress"])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_convergence(tmp_path, capsys):
    out = tmp_path / "conv"
    assert cli.main(["bench", "--convergence", "--seeds", "2", *TINY, "--steps", "3", "--presets", "4bit",
                     "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    columns, rows = read_csv(out / "convergence.csv")
    assert columns == ["run", "seed", "final_val_loss", "gap_pct"]
    assert [(r["run"], r["seed"]) for r in rows] == [("adamw", "0"), ("adamw", "1"), ("optstate-4bit", "0"),
                                                     ("optstate-4bit", "1")]
    loss = {(r["run"], r["seed"]): float(r["final_val_loss"]) for r in rows}
    assert loss["adamw", "0"] != loss["adamw", "1"]  # seeds change the run
    for r in rows:
        expected = 100 * (loss[r["run"], r["seed"]] - loss["adamw", r["seed"]]) / loss["adamw", r["seed"]]
        assert float(r["gap_pct"]) == pytest.approx(expected, rel=1e-4, abs=1e-6)
    a0, a1 = loss["adamw", "0"], loss["adamw", "1"]
    spread = 100 * abs(a0 - a1) / ((a0 + a1) / 2)
    assert f"max - min {spread:.3f}%" in printed
    assert "| optstate-4bit |" in printed and "| adamw |" in printed


def test_finetune_runs_start_from_the_pretrained_checkpoint(tmp_path):
    """--finetune: every run (AdamW, int-moment and master-weight presets, every seed) starts from
    the one AdamW checkpoint; with a learning rate of ~0 each ends at that checkpoint's loss on the
    fine-tuning text (bf16w casts the weights: within bf16 rounding)."""
    from optstate_core.apps import convergence
    from optstate_core.apps.tinylm import TinyLM

    cfg = demo.DemoConfig(steps=2, batch_size=2, seq_len=16, d_model=64, n_layers=1, n_heads=2, eval_every=2,
                          eval_batches=1, warmup_steps=1, max_bytes=50000, device="cpu")
    text = tmp_path / "tune.py"
    text.write_bytes((ROOT / "optstate_core" / "optimizer.py").read_bytes())
    tuned = demo.load_corpus(str(text), cfg.max_bytes)
    state = convergence.pretrain(cfg, 30, demo.load_corpus(None, cfg.max_bytes), progress=False)
    torch.manual_seed(123)
    model = TinyLM.from_config(cfg)
    scratch = demo.evaluate(model, tuned.val, demo.val_offsets(tuned, cfg), cfg)
    model.load_state_dict(state)
    start = demo.evaluate(model, tuned.val, demo.val_offsets(tuned, cfg), cfg)
    assert start < scratch - 0.3  # the checkpoint learned something
    import dataclasses
    result = convergence.run_convergence(dataclasses.replace(cfg, lr=1e-12), ["4bit", "bf16w-8bit"], [0, 1],
                                         progress=False, corpus=tuned, init_state=state)
    assert [r.run for r in result.rows] == ["adamw", "optstate-4bit", "optstate-bf16w-8bit"]
    for row in result.rows:
        rel = 1e-2 if "bf16w" in row.run else 1e-4
        assert row.val_losses == pytest.approx([start, start], rel=rel), row.run


def test_finetune_command(tmp_path, capsys):
    text = tmp_path / "tune.py"
    text.write_bytes((ROOT / "optstate_core" / "optimizer.py").read_bytes())
    assert cli.main(["bench", "--convergence", "--finetune", "--pretrain-steps", "3", "--finetune-data", str(text),
                     "--finetune-lr", "1e-4", "--seeds", "2", *TINY, "--steps", "2", "--presets", "8bit"]) == 0
    printed = capsys.readouterr().out
    assert "pretraining the checkpoint: AdamW, 3 steps" in printed
    assert f"fine-tuning from it on {text} at lr 0.0001" in printed
    assert "| optstate-8bit |" in printed


@pytest.mark.parametrize("argv,message", [
    (["--finetune", "--pretrain-steps", "0"], "--pretrain-steps"),
    (["--finetune", "--finetune-lr", "-1"], "--finetune-lr"),
    (["--finetune-lr", "0.1"], "--finetune-lr needs --finetune"),
    (["--finetune", "--finetune-data", "/nonexistent/dir"], "--finetune-data"),
])
def test_finetune_bad_input_is_a_usage_error(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "--convergence", *argv, *TINY, "--steps", "2", "--presets", "8bit"])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_bench_without_convergence_runs_the_microbenchmark(capsys):
    assert cli.main(["bench", "--scale", "0.01", "--layers", "1", "--steps", "2", "--warmup", "1",
                     "--configs", "int8", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "optstate int8" in out and "torch AdamW" in out


def test_bench_times_master_weight_presets_beside_fp32_adamw(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert cli.main(["bench", "--scale", "0.01", "--layers", "1", "--steps", "1", "--warmup", "1", "--device", "cpu",
                     "--configs", "bf16w-4bit-lean,bf16w-4bit-lean-hostcorr", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    rows = {r["config"]: r for r in json.loads(out.read_text())["rows"]}
    adamw, lean, host = (rows["torch AdamW foreach"], rows["optstate bf16w-4bit-lean"],
                         rows["optstate bf16w-4bit-lean-hostcorr"])
    assert adamw["weights"] == "float32" and lean["weights"] == host["weights"] == "bfloat16"
    n = lean["n_params"]
    assert n == adamw["n_params"] == host["n_params"] and lean["step_ms"] > 0 and host["step_ms"] > 0
    assert lean["host_bytes"] == 0 and host["host_bytes"] == n  # corr8: one byte per parameter, in host memory
    assert lean["bits_per_param"] - host["bits_per_param"] == pytest.approx(8.0)
    assert "| optstate bf16w-4bit-lean           |   bf16 |" in printed and "state bits include the master" in printed
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "--device", "cpu", "--configs", "int8,bf16w-2bit"])
    assert e.value.code == 2 and "--configs: unknown configuration bf16w-2bit" in capsys.readouterr().err


def test_bench_dispatch_and_steps_defaults(monkeypatch):
    from optstate_core.apps import bench, convergence
    seen = []
    monkeypatch.setattr(bench, "run", lambda args: seen.append(("bench", args.steps)) or 0)
    monkeypatch.setattr(convergence, "run", lambda args: seen.append(("convergence", args.steps)) or 0)
    own = argparse.ArgumentParser()
    bench.add_arguments(own)
    bench_default = own.get_default("steps")  # bench.py's own default for timed steps
    for argv in (["bench"], ["bench", "--steps", "3"], ["bench", "--convergence"],
                 ["bench", "--convergence", "--steps", "7"]):
        assert cli.main(argv) == 0
    assert seen == [("bench", bench_default), ("bench", 3), ("convergence", None), ("convergence", 7)]


@pytest.mark.parametrize("argv,expected", [
    ([], ["demo", "bench", "plan", "env"]),
    (["env"], ["--markdown", "OPTSTATE_"]),
    (["demo"], ["--presets", "--steps", "--out", "--device", "--data"]),
    (["bench"], ["--convergence", "--seeds", "--presets", "--steps", "--scale"]),
    (["plan"], ["--params", "--config", "--gpu-memory", "--optimizer", "--activations", "--weights-dtype"]),
])
def test_help(argv, expected, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main([*argv, "--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for word in expected:
        assert word in text


def test_python_dash_m():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "integrations")])}
    proc = subprocess.run([sys.executable, "-m", "optstate_core", "plan", "--params", "1B", "--gpu-memory", "24GB"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "1,000,000,000 parameters" in proc.stdout and "| 8bit |" in proc.stdout


def test_console_script_is_declared():
    text = (ROOT / "pyproject.toml").read_text()
    assert 'optstate = "optstate_core.apps.cli:main"' in text


def test_demo_defaults_are_what_the_help_says():
    # `python -m optstate_core demo` with no arguments: AdamW, 8bit and 4bit, on CUDA if present
    args = cli.build_parser().parse_args(["demo"])
    cfg = demo.config_from_args(args)
    assert demo.parse_presets(args.presets) == ["8bit", "4bit"]
    assert cfg.device == ("cuda" if torch.cuda.is_available() else "cpu")
    assert cfg == demo.DemoConfig(device=cfg.device)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_demo_on_cuda(tmp_path):
    out = tmp_path / "cuda"
    argv = [a if a != "cpu" else "cuda" for a in TINY]
    assert cli.main(["demo", *argv, "--presets", "8bit,offload", "--out", str(out), "--no-plot"]) == 0
    _, rows = read_csv(out / "metrics.csv")
    assert {r["run"] for r in rows} == {"adamw", "optstate-8bit", "optstate-offload"}
    for r in rows:
        assert 0 < float(r["gpu_mem_mb"]) <= float(r["gpu_peak_mb"])
    last = {r["run"]: r for r in rows}
    assert float(last["optstate-8bit"]["tensor_mem_mb"]) < 0.5 * float(last["adamw"]["tensor_mem_mb"])


@pytest.mark.parametrize("tune", ["0x1", "2", "1x1x1x1x1", "ax2", "2x2x0"])
def test_bench_tune_bad_shape_is_a_usage_error(tune, capsys):
    """``bench --tune`` items are TILESxWARPS[xLOOPS[xREGISTERS]]; anything else names the flag."""
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "--tune", tune, *TINY, "--steps", "1", "--configs", "int8"])
    assert e.value.code == 2
    assert f"--tune: {tune!r}" in capsys.readouterr().err


def test_bench_tune_shapes_parse_with_defaults():
    from optstate_core.apps.bench import tune_shape
    assert tune_shape("2x4") == (2, 4, 1, 0)
    assert tune_shape("1x1x16") == (1, 1, 16, 0)
    assert tune_shape("1x1x16x64") == (1, 1, 16, 64)


def test_convergence_with_gradient_release_and_the_clip_rule(capsys):
    """``+release`` presets update in backward and clip by the previous step's norm; with
    ``--clip 0`` nothing clips, and fp32 + release is AdamW's run bit for bit (same final loss)."""
    from optstate_core.apps import convergence, demo

    cfg = demo.config_from_args(cli.build_parser().parse_args(["demo", *TINY, "--clip", "0"]))
    result = convergence.run_convergence(cfg, ["fp32+release", "8bit+release"], [0, 1], progress=False)
    losses = {r.run: r.val_losses for r in result.rows}
    assert losses["optstate-fp32+release"] == losses["adamw"]
    # clipping active every step: the default rule clips by the exact global norm (this model's
    # gradients are one batch), so AdamW's run up to the order the norm sums in; per tensor differs
    clipped = demo.config_from_args(cli.build_parser().parse_args(["demo", *TINY, "--clip", "0.01"]))
    result = convergence.run_convergence(clipped, ["fp32+release"], [0, 1], progress=False)
    losses_clipped = {r.run: r.val_losses for r in result.rows}
    assert losses_clipped["optstate-fp32+release"] == pytest.approx(losses_clipped["adamw"], rel=1e-5)
    per_tensor = demo.config_from_args(cli.build_parser().parse_args(["demo", *TINY, "--clip", "0.01",
                                                                      "--clip-mode", "per_tensor"]))
    result = convergence.run_convergence(per_tensor, ["fp32+release"], [0, 1], progress=False)
    losses_per_tensor = {r.run: r.val_losses for r in result.rows}
    assert losses_per_tensor["optstate-fp32+release"] != pytest.approx(losses_per_tensor["adamw"], rel=1e-4)
    # --release-bucket-bytes 0: one update per gradient, so "previous" clips one step late
    late = demo.config_from_args(cli.build_parser().parse_args(["demo", *TINY, "--clip", "0.01", "--clip-mode",
                                                                "previous", "--release-bucket-bytes", "0"]))
    assert demo.build_optimizer(demo.TinyLM.from_config(late), late,
                                "8bit+release")._engine.clip_release.bucket_bytes == 0
    result = convergence.run_convergence(late, ["fp32+release"], [0, 1], progress=False)
    losses_late = {r.run: r.val_losses for r in result.rows}
    assert losses_late["optstate-fp32+release"] != pytest.approx(losses_late["adamw"], rel=1e-4)
    with pytest.raises(SystemExit):
        cli.main(["demo", *TINY, "--release-bucket-bytes", "lots"])
    assert "--release-bucket-bytes must be a byte count" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["demo", *TINY, "--presets", "8bit+later"])
    assert "unknown preset '8bit+later'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["demo", *TINY, "--clip", "-1"])
    assert "--clip must be a number >= 0" in capsys.readouterr().err
    assert demo.build_optimizer(demo.TinyLM.from_config(per_tensor), per_tensor,
                                "8bit+release")._engine.clip_release.clip_mode == "per_tensor"
    with pytest.raises(SystemExit):
        cli.main(["demo", *TINY, "--clip-mode", "global"])
    assert "--clip-mode must be auto, previous or per_tensor" in capsys.readouterr().err


def test_e2e_clip_all_clips_the_rows_without_release_too():
    """``bench --e2e --clip-all``: a preset without release clips globally in step(), as its release
    row clips in backward, so the two rows do the same work; non-optstate rows never clip."""
    from optstate_core.apps.e2e import contender_configs

    ps = [torch.nn.Parameter(torch.zeros(8, 256))]
    for clip_all in (False, True):
        configs = contender_configs("adamw,8bit+norelease,8bit+release", 1.0, clip_all)
        opts = {name: build(ps, None) for name, (build, _) in configs.items()}
        assert opts["8bit+release"].max_grad_norm == 1.0 and opts["8bit+release"].clip_mode == "auto"
        assert opts["8bit+norelease"].max_grad_norm == (1.0 if clip_all else None)
        assert opts["8bit+norelease"].clip_mode == "global" and not hasattr(opts["adamw"], "max_grad_norm")
        for opt in opts.values():
            getattr(opt, "close", lambda: None)()
