"""examples/hf_trainer_finetune.py runs end to end and reports the memory saved."""
import importlib.util
import re
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from hf_testlib import one_thread  # noqa: E402,F401

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "hf_trainer_finetune.py"


@pytest.mark.usefixtures("one_thread")
def test_example_runs_and_saves_memory(capsys):
    spec = importlib.util.spec_from_file_location("hf_trainer_finetune", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(["--steps", "5", "--optim", "optstate_adamw_4bit", "--threads", "1"])
    out = capsys.readouterr().out
    saved = re.search(r"optimizer memory saved: ([0-9.]+) MiB \(([0-9.]+)% less than adamw_torch\)", out)
    assert saved, out
    assert float(saved.group(1)) > 0 and 50 < float(saved.group(2)) < 100
