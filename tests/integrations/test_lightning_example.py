"""examples/lightning_finetune.py runs offline on CPU and reports the optimizer memory saved."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lightning")

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(200)
def test_lightning_finetune_example_runs():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "integrations")]))
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "lightning_finetune.py"), "--epochs", "1",
                          "--samples", "64"],
                         env=env, capture_output=True, text=True, timeout=190)
    assert out.returncode == 0, out.stderr[-2000:]
    saved = next(line for line in out.stdout.splitlines() if "optimizer memory saved" in line)
    percent = float(saved.rsplit("(", 1)[1].rstrip("%)"))
    assert percent > 50  # int8 m and v (small tensors fp32) against fp32 AdamW state
