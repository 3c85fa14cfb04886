"""optim="optstate_..." with no optstate import: the .pth hook (optstate_hf_names) in fresh interpreters
and torchrun workers, its off switch, the wheel that carries it, and the OptStateCallback a Trainer
gets when it creates its optimizer from one of the names.

The subprocesses do not depend on how optstate is installed here (editable, wheel, or not at all):
each gets a throwaway site directory holding the repository's .pth, added by a sitecustomize on
PYTHONPATH, so the fresh interpreter processes the line exactly as it would from site-packages."""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

pytest.importorskip("transformers")

import optstate_hf  # noqa: E402
import optstate_hf_names  # noqa: E402
from hf_testlib import make_trainer, one_thread, tiny_dataset, tiny_model, training_args  # noqa: E402,F401
from optstate_hf_names.__main__ import main as pth_command  # noqa: E402
from transformers import Trainer  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
PTH = ROOT / "integrations" / "optstate_hf_names" / optstate_hf_names.PTH_NAME
HEAVY = ("torch", "transformers", "optstate_core", "optstate_hf")


def fresh_env(tmp_path, **extra) -> dict:
    """The environment of a fresh interpreter that runs the .pth line as site-packages would."""
    site_dir, boot = tmp_path / "site", tmp_path / "boot"
    site_dir.mkdir(parents=True)
    boot.mkdir()
    shutil.copy(PTH, site_dir)
    (boot / "sitecustomize.py").write_text(f"import site\nsite.addsitedir({str(site_dir)!r})\n")
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    env.pop(optstate_hf_names.ENV, None)
    env["PYTHONPATH"] = os.pathsep.join([str(boot), str(ROOT), str(ROOT / "integrations")]
                                        + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.update(extra)
    return env


def run_script(tmp_path, source: str, env: dict, *args, launcher=()) -> str:
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(source))
    proc = subprocess.run([sys.executable, *launcher, str(script), *args], capture_output=True, text=True,
                          timeout=240, env=env, cwd=str(tmp_path))
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    return proc.stdout


NAMES_AND_TINY_RUN = """
    import json, sys
    heavy_at_start = [m for m in {heavy!r} if m in sys.modules]
    hooked = "optstate_hf_names" in sys.modules and any(type(f).__name__ == "PostImportFinder" for f in sys.meta_path)
    from transformers import TrainingArguments
    out, names = sys.argv[1], json.loads(sys.argv[2])
    for name in names:  # every registered name, no optstate import
        args = TrainingArguments(output_dir=out, optim=name, report_to=[], use_cpu=True)
        assert args.optim == name, (args.optim, name)
    optstate_after_args = [m for m in ("optstate_core", "optstate_hf") if m in sys.modules]

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    g = torch.Generator().manual_seed(0)
    rows = [{{"input_ids": ids, "labels": ids.clone()}} for ids in torch.randint(0, 64, (16, 16), generator=g)]
    args = TrainingArguments(output_dir=out, optim="optstate_adamw_8bit", optim_args="min_int8_elements=0",
                             max_steps=3, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                             learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
                             disable_tqdm=True, dataloader_num_workers=0)
    trainer = Trainer(model=model, args=args, train_dataset=rows)  # no callback passed
    trainer.train()
    opt = trainer.optimizer
    while not hasattr(opt, "step_count") and hasattr(opt, "optimizer"):
        opt = opt.optimizer
    logs = [e for e in trainer.state.log_history if "loss" in e]
    print(json.dumps({{"heavy_at_start": heavy_at_start, "hooked": hooked, "optstate_after_args": optstate_after_args,
                      "callbacks": [type(c).__name__ for c in trainer.callback_handler.callbacks],
                      "optimizer": type(opt).__module__ + "." + type(opt).__name__, "steps": opt.step_count,
                      "codecs": sorted(opt.memory_report()["by_codec"]), "logs": logs}}))
"""


def test_every_name_is_valid_in_a_fresh_interpreter_and_the_trainer_attaches_the_callback(tmp_path):
    names = sorted(optstate_hf.OPTIM_NAMES)
    out = run_script(tmp_path, NAMES_AND_TINY_RUN.format(heavy=HEAVY), fresh_env(tmp_path), str(tmp_path / "out"),
                     json.dumps(names))
    result = json.loads(out.strip().splitlines()[-1])
    assert result["hooked"] and result["heavy_at_start"] == []  # the .pth line imports nothing heavy
    assert result["optstate_after_args"] == []  # the names were valid with no optstate import
    assert result["optimizer"] == "optstate_hf.optimizer.OptStateAdamW" and result["steps"] == 3
    assert result["codecs"] == ["fp32", "int8"]  # fp32: 1-D states not a whole number of 256-blocks
    assert result["callbacks"].count("OptStateCallback") == 1 and result["callbacks"][0] == "OptStateCallback"
    assert len(result["logs"]) == 3 and all("optstate/bits_per_param" in e for e in result["logs"])


def test_the_environment_variable_turns_the_hook_off(tmp_path):
    source = """
        import sys
        assert not any(type(f).__name__ == "PostImportFinder" for f in sys.meta_path)
        from transformers import TrainingArguments
        try:
            TrainingArguments(output_dir=sys.argv[1], optim="optstate_adamw", report_to=[], use_cpu=True)
        except ValueError as e:
            print("rejected:", e)
        else:
            print("accepted")
    """
    out = run_script(tmp_path, source, fresh_env(tmp_path, **{optstate_hf_names.ENV: "0"}), str(tmp_path / "out"))
    assert "rejected: optstate_adamw is not a valid OptimizerNames" in out


TORCHRUN_WORKER = """
    import json, os, sys
    from transformers import TrainingArguments
    out, names = sys.argv[1], json.loads(sys.argv[2])
    valid = []
    for name in names:
        args = TrainingArguments(output_dir=out, optim=name, report_to=[], use_cpu=True, ddp_backend="gloo")
        valid.append(args.optim == name)
    import torch.distributed as dist
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ["WORLD_SIZE"])
    result = {"rank": int(os.environ["RANK"]), "world": world, "valid": valid,
              "optstate": [m for m in ("optstate_core", "optstate_hf") if m in sys.modules]}
    with open(os.path.join(out, f"rank{os.environ['RANK']}.json"), "w") as f:
        json.dump(result, f)
"""


def test_every_name_is_valid_in_each_torchrun_worker(tmp_path):
    names = sorted(optstate_hf.OPTIM_NAMES)
    out = tmp_path / "out"
    out.mkdir()
    launcher = ("-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2")
    run_script(tmp_path, TORCHRUN_WORKER, fresh_env(tmp_path), str(out), json.dumps(names), launcher=launcher)
    for rank in range(2):
        result = json.loads((out / f"rank{rank}.json").read_text())
        assert result["rank"] == rank and result["world"] == 2
        assert result["valid"] == [True] * len(names) and result["optstate"] == []


def _can_build_wheels() -> bool:  # setuptools >= 70.1 has bdist_wheel, older ones need the wheel package
    setuptools = importlib.util.find_spec("setuptools")  # (not imported: it patches distutils)
    if setuptools is None:
        return False
    return (Path(setuptools.origin).parent / "command" / "bdist_wheel.py").exists() or \
        importlib.util.find_spec("wheel") is not None


@pytest.mark.skipif(not _can_build_wheels(), reason="no bdist_wheel here (setuptools < 70.1 without wheel)")
def test_the_wheel_carries_the_pth_at_its_root(tmp_path):
    """What a non-editable install puts into site-packages (setup.py's build_py)."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, src)
    for name in ("optstate_core", "integrations"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "--disable-pip-version-check", "-w", str(tmp_path / "dist"), str(src)],
                   check=True, capture_output=True, timeout=120)
    (wheel,) = (tmp_path / "dist").glob("optstate-*.whl")
    with zipfile.ZipFile(wheel) as z:
        assert z.read(optstate_hf_names.PTH_NAME) == PTH.read_bytes()
        record = next(n for n in z.namelist() if n.endswith(".dist-info/RECORD"))
        assert any(line.startswith(optstate_hf_names.PTH_NAME + ",") for line in z.read(record).decode().splitlines())
        assert "optstate_hf_names/__init__.py" in z.namelist()


def test_the_install_command_for_editable_installs(tmp_path, capsys):
    line = PTH.read_text()
    assert line.startswith("import ") and line.count("\n") == 1 and "install_hook()" in line
    assert pth_command(["install", "--dir", str(tmp_path)]) == 0
    assert (tmp_path / optstate_hf_names.PTH_NAME).read_text() == line
    assert pth_command(["install", "--dir", str(tmp_path)]) == 0 and "up to date" in capsys.readouterr().out
    assert pth_command(["uninstall", "--dir", str(tmp_path)]) == 0
    assert not (tmp_path / optstate_hf_names.PTH_NAME).exists()
    assert '"-m", "optstate_hf_names", "install"' in (ROOT / "quickstart.py").read_text()


def _callbacks(trainer, cls=optstate_hf.OptStateCallback):
    return [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, cls)]


@pytest.mark.usefixtures("one_thread")
def test_a_trainer_that_creates_an_optstate_optimizer_gets_the_callback(tmp_path):
    """No callback passed, release with clipping: the callback was there at on_train_begin (the logged
    grad_norm is the optimizer's, the Trainer's own would be 0 after release) and logs the metrics."""
    trainer = make_trainer(tmp_path / "auto", callbacks=[], max_steps=2, max_grad_norm=1.0,
                           optim_args="min_int8_elements=0,release_gradients=true")
    trainer.train()
    (callback,) = _callbacks(trainer)
    assert trainer.callback_handler.callbacks[0] is callback
    logs = [e for e in trainer.state.log_history if "loss" in e]
    assert len(logs) == 2 and all(e["grad_norm"] > 0 and "optstate/bits_per_param" in e for e in logs)

    own = optstate_hf.OptStateCallback(log_metrics=False)
    trainer = make_trainer(tmp_path / "own", callbacks=[own], max_steps=1)
    trainer.train()
    assert _callbacks(trainer) == [own]  # the user's, not a second one


@pytest.mark.usefixtures("one_thread")
def test_no_callback_for_optimizers_the_names_did_not_create(tmp_path):
    plain = make_trainer(tmp_path / "plain", callbacks=[], optim="adamw_torch", optim_args=None, max_steps=1)
    plain.create_optimizer()
    args = training_args(tmp_path / "explicit", optim="adamw_torch", optim_args=None)
    explicit = Trainer(model=tiny_model(), args=args, train_dataset=tiny_dataset(8),
                       optimizer_cls_and_kwargs=optstate_hf.optimizer_cls_and_kwargs(args, preset="8bit"))
    explicit.create_optimizer()
    assert optstate_hf.find_virtual_optimizer(explicit.optimizer) is not None
    assert _callbacks(plain) == [] and _callbacks(explicit) == []
    assert Trainer.create_optimizer.optstate_original is not None
