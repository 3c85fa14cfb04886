"""``optstate bench --capacity`` and ``--peak-bytes``: the model ladder, the search (with an injected
fits()), the table from injected trial results, and real tiny CPU trials through the subprocess runner."""
import argparse
import json
import math

import pytest
import torch

from optstate_core.apps import capacity, cli, contenders, peakbytes
from optstate_core.apps.llama import NAMED_SHAPES, LlamaShape, build_model
from optstate_core.apps.trial import TrialSpec, run_in_subprocess


def test_shape_params_are_exact_and_the_ladder_grows():
    for shape in (NAMED_SHAPES["tiny"], LlamaShape.grown(256, 3, 512)):
        model = build_model(shape, "cpu", torch.bfloat16)
        assert sum(p.numel() for p in model.parameters()) == shape.params
        assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    # the 8B config is Llama-3-8B's parameter count (untied, vocab 128256)
    assert NAMED_SHAPES["8b"].params == 8_030_261_248
    shapes = capacity.ladder([2048, 4096, 8192], 32, 32000)
    sizes = [s.params for s in shapes]
    assert all(a < b for a, b in zip(sizes, sizes[1:]))
    assert [s.hidden for s in shapes] == sorted(s.hidden for s in shapes)
    assert shapes[0] == LlamaShape.grown(2048, 1, 32000) and shapes[31].layers == 32
    assert shapes[32].hidden == 4096 and shapes[32].params > shapes[31].params
    assert shapes[-1].hidden == 8192 and shapes[-1].layers == 128 and sizes[-1] > 80e9


def test_meta_built_model_matches_a_normally_built_one():
    from transformers import LlamaForCausalLM
    model = build_model(NAMED_SHAPES["tiny"], "cpu")
    ref = LlamaForCausalLM(model.config)
    ref.load_state_dict(model.state_dict())
    x = torch.randint(0, 256, (2, 12))
    assert torch.equal(model(input_ids=x).logits, ref(input_ids=x).logits)  # rotary buffers recomputed


def _threshold(sizes, limit, log):
    def fits(i):
        log.append(i)
        return "ok" if sizes[i] <= limit else "oom"
    return fits


@pytest.mark.parametrize("start", [0, 5, 40, 99])
@pytest.mark.parametrize("limit", [1.0, 7.5, 33.3, 150.0, 10_000.0])
def test_search_brackets_the_largest_fit(start, limit):
    sizes = [1.0 + 1.5 * k for k in range(100)]  # 1 .. 149.5
    log = []
    r = capacity.search(sizes, _threshold(sizes, limit, log), start, max_trials=40, resolution=0.0)
    want = max((j for j, n in enumerate(sizes) if n <= limit), default=None)
    assert r.fit == want and r.error is None
    assert r.no_fit == (None if want == len(sizes) - 1 else (0 if want is None else want + 1))
    assert len(log) == len(set(log)) == len(r.trials) <= 2 + 2 * math.ceil(math.log2(len(sizes)))


@pytest.mark.parametrize("overhead", [0.0, 3e9, 20e9])
def test_search_guided_by_measured_peaks_needs_few_trials(overhead):
    shapes = capacity.ladder([2048, 4096, 8192], 32, 32000)
    sizes = [s.params for s in shapes]
    total = 80 * 2**30  # bytes; a trial's peak = overhead + 10 bytes/param, what fits is what peaks below total
    usable = total - capacity.RESERVED_BYTES
    log = []

    def fits(i):
        log.append(i)
        return "ok" if overhead + 10 * sizes[i] <= usable else "oom"

    def predict(i):
        return sizes[i] * usable / (overhead + 10 * sizes[i])
    r = capacity.search(sizes, fits, capacity.start_index(sizes, 16.0, total), 20, 0.0, predict=predict)
    want = max(j for j, n in enumerate(sizes) if overhead + 10 * n <= usable)
    assert (r.fit, r.no_fit) == (want, want + 1)
    blind = capacity.search(sizes, _threshold(sizes, (usable - overhead) / 10, []),
                            capacity.start_index(sizes, 16.0, total), 20, 0.0)
    assert (blind.fit, blind.no_fit) == (want, want + 1)
    assert len(r.trials) <= 5 and len(r.trials) < len(blind.trials)


def test_search_stops_at_resolution_trials_time_and_errors():
    sizes = [float(2 ** (k / 8)) for k in range(80)]  # 1 .. ~960, 9% apart
    r = capacity.search(sizes, _threshold(sizes, 300.0, []), 0, max_trials=40, resolution=0.25)
    assert sizes[r.fit] <= 300.0 < sizes[r.no_fit] <= sizes[r.fit] * 1.25
    assert r.no_fit - r.fit > 1  # stopped on resolution, not on adjacency
    r = capacity.search(sizes, _threshold(sizes, 300.0, []), 0, max_trials=3, resolution=0.0)
    assert len(r.trials) == 3 and sizes[r.fit] <= 300.0
    r = capacity.search(sizes, _threshold(sizes, 300.0, []), 0, max_trials=40, resolution=0.0,
                        out_of_time=lambda: True)
    assert len(r.trials) == 1
    r = capacity.search(sizes, lambda i: "ok" if i < 10 else "error", 0, max_trials=40, resolution=0.0)
    assert r.error == "error" and sizes[r.fit] < sizes[10]
    r = capacity.search(sizes, lambda i: "timeout", 50, max_trials=40, resolution=0.0)
    assert r.fit is None and r.no_fit == 0
    with pytest.raises(ValueError, match="ladder"):
        capacity.search([], lambda i: "ok", 0, 3, 0.1)


def test_contender_names():
    c = contenders.parse("bf16w-4bit-lean")
    assert c.weights == torch.bfloat16 and c.release and not c.offload and not c.autocast
    c = contenders.parse("bf16w-8bit+offload+norelease")
    assert c.offload and not c.release and c.preset == "bf16w-8bit"
    c = contenders.parse("int8+release")
    assert c.preset == "8bit" and c.release and c.weights == torch.float32 and c.autocast
    assert contenders.parse("adamw").weights == torch.float32
    assert contenders.parse("none-bf16").weights == torch.bfloat16
    assert contenders.hint_bytes_per_param(contenders.parse("bf16w-4bit-lean")) == 4.0
    c = contenders.parse("flashoptim+release")
    assert c.base == "flashoptim" and c.release and c.weights == torch.bfloat16
    assert contenders.hint_bytes_per_param(c) == 5.0
    assert contenders.hint_bytes_per_param(contenders.parse("flashoptim")) == 7.0
    assert contenders.unavailable(c) == contenders.unavailable(contenders.parse("flashoptim"))
    c = contenders.parse("bf16w-4bit-lean+budget3GiB")
    assert c.gpu_budget == 3 * 2**30 and c.release and c.preset == "bf16w-4bit-lean"
    for bad, match in (("adamw+offload", "suffixes"), ("bnb8+release", "suffixes"), ("8bit+fast", "suffix"),
                       ("sgd", "preset"), ("adamw+budget1GB", "optstate presets only"), ("8bit+budgetx", "budget")):
        with pytest.raises(ValueError, match=match):
            contenders.parse(bad)


def _args(**kw):
    base = dict(optimizers=None, widths="64,128", max_layers=4, vocab=256, batch=1, seq=8, checkpointing=True,
                device="cpu", steps=1, max_trials=6, resolution=0.0, time_budget=600.0, trial_timeout=60.0,
                gpu_memory_bytes=None, json=None, models="tiny", memory_cap=None, accumulate=1)
    return argparse.Namespace(**{**base, **kw})


def test_capacity_table_from_injected_trials(tmp_path, capsys):
    budgets = {"adamw": 200_000, "8bit": 400_000}  # params that "fit" per optimizer
    seen = []

    def runner(spec, timeout):
        n = LlamaShape(**spec.shape).params
        seen.append((spec.optimizer, n, spec.batch, spec.seq, spec.device))
        if n > budgets[spec.optimizer]:
            return {"status": "oom", "params": n}
        return {"status": "ok", "params": n, "step_s": 0.5, "tokens_per_s": 16.0, "peak_bytes": 3 * 2**30}
    out = tmp_path / "cap.json"
    assert capacity.run_capacity(_args(optimizers="adamw,8bit,flashoptim", json=str(out), max_trials=20), runner) == 0
    printed = capsys.readouterr().out
    rows = {r["optimizer"]: r for r in json.loads(out.read_text())["rows"]}
    sizes = [s.params for s in capacity.ladder([64, 128], 4, 256)]
    for name, limit in budgets.items():
        assert rows[name]["params"] == max(n for n in sizes if n <= limit)
        assert rows[name]["no_fit_params"] == min(n for n in sizes if n > limit)
        assert f"| {name} | {rows[name]['params'] / 1e9:.2f} |" in printed
        assert f"| {rows[name]['no_fit_params'] / 1e9:.2f} (OOM) |" in printed
    assert all(batch == 1 and seq == 8 and device == "cpu" for _, _, batch, seq, device in seen)
    if contenders.unavailable(contenders.parse("flashoptim")):
        assert rows["flashoptim"]["status"] == "unavailable" and "| flashoptim | unavailable" in printed
    with pytest.raises(ValueError, match="optimizer 'sgdx'"):
        capacity.run_capacity(_args(optimizers="adamw,sgdx"), runner)


def test_peak_bytes_rows_subtract_the_activation_baseline(capsys):
    def runner(spec, timeout):
        n = LlamaShape(**spec.shape).params
        wb = n * (2 if spec.optimizer.endswith("bf16") or spec.optimizer.startswith("bf16w") else 4)
        peak = {"none": 4 * n + 1000, "none-bf16": 2 * n + 700, "adamw": None, "bf16w-4bit-lean": 4 * n + 700}
        if peak[spec.optimizer] is None:
            return {"status": "oom", "params": n, "error": "CUDA out of memory"}
        return {"status": "ok", "params": n, "weight_bytes": wb, "peak_step_bytes": peak[spec.optimizer],
                "held_bytes": 4 * n, "step_s": 2.0, "tokens_per_s": 1024.0}
    seen = []

    def recording(spec, timeout):
        seen.append((spec.memory_cap, spec.accumulate))
        return runner(spec, timeout)
    args = _args(optimizers="adamw,bf16w-4bit-lean", models="tiny,8b", batch=1, seq=2048, memory_cap="24GB",
                 accumulate=2)
    assert peakbytes.run_peak_bytes(args, recording) == 0
    assert set(seen) == {(24 * 10**9, 2)}
    printed = capsys.readouterr().out
    assert "2 micro-batch(es) per step" in printed and "capped at 24GB" in printed
    assert "| tiny (0.00B) | bf16w-4bit-lean | ok |" in printed and "| 8b (8.03B) | adamw | OOM |" in printed
    assert "| 4.00 | 4.00 | 2.000 | 1024 |" in printed  # (4n + 700 - 700) / n at the peak, 4n held
    with pytest.raises(ValueError, match="--models"):
        peakbytes.run_peak_bytes(_args(models="13b"), runner)


def test_trial_subprocess_times_out_and_is_killed():
    spec = TrialSpec(NAMED_SHAPES["tiny"].to_dict(), "adamw", 1, 8, True, "cpu", 1, 1)
    r = run_in_subprocess(spec, timeout=0.05)
    assert r["status"] == "timeout" and "0 s" in r["error"]


def test_trial_killed_by_sigkill_counts_as_out_of_memory(monkeypatch):
    import optstate_core.apps.trial as trial
    real = trial.subprocess.Popen

    def popen(cmd, **kw):  # a child the OOM killer ends
        return real([cmd[0], "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"], **kw)
    monkeypatch.setattr(trial.subprocess, "Popen", popen)
    r = run_in_subprocess(TrialSpec(NAMED_SHAPES["tiny"].to_dict(), "adamw", device="cpu"), timeout=60)
    assert r["status"] == "oom" and "SIGKILL" in r["error"]


def test_real_tiny_trials_on_cpu(tmp_path, capsys):
    # state resident up to a budget, the rest streamed (+budget), two micro-batches a step, release on the last
    spec = TrialSpec(NAMED_SHAPES["tiny"].to_dict(), "bf16w-4bit-lean+budget64KB", 2, 16, True, "cpu", 2, 1,
                     accumulate=2)
    r = run_in_subprocess(spec, timeout=300)
    assert r["status"] == "ok", r
    assert r["params"] == NAMED_SHAPES["tiny"].params and math.isfinite(r["loss"]) and r["step_s"] > 0
    assert r["weight_bytes"] == 2 * r["params"]  # bf16 weights
    assert r["tokens_per_s"] == pytest.approx(2 * 2 * 16 / r["step_s"])
    # optstate's memory_report: correction + moments, on the device up to the budget, the rest on the host
    assert 0 < r["optimizer_device_bytes"] <= 64 * 1024 and r["optimizer_host_bytes"] > 0
    # the peak-bytes mode end to end through the command line: baseline + AdamW, one subprocess each
    out = tmp_path / "pb.json"
    assert cli.main(["bench", "--peak-bytes", "--device", "cpu", "--models", "tiny", "--optimizers", "adamw",
                     "--seq", "16", "--steps", "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["model"], r["optimizer"], r["status"]) for r in rows] == [("tiny", "adamw", "ok")]
    assert rows[0]["step_s"] > 0 and rows[0]["peak_bytes"] is None  # no CUDA: no peak figures
    assert "| tiny (0.00B) | adamw | ok |" in capsys.readouterr().out
