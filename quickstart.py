#!/usr/bin/env python3
"""Quick start on a fresh machine (only Python 3 and pip needed).

    python3 quickstart.py demo   # the main job: train a small LM with AdamW vs optstate presets (CPU)
    python3 quickstart.py test   # the whole test suite (one worker per core; prints the 20 slowest tests)

The first run creates ./.venv and installs the CPU build of torch 2.13.0 and this project with
its dev extra, every other package at the version constraints.txt pins; later runs reuse it. Extra arguments go to the demo / to pytest.
"""
import hashlib
import os
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = Path(os.environ.get("OPTSTATE_VENV", ROOT / ".venv"))
TORCH = os.environ.get("OPTSTATE_TORCH", "torch==2.13.0")
CONSTRAINTS = ROOT / "constraints.txt"  # every other test dependency, pinned (tools/update_pins.py)
# makes optim="optstate_..." valid without an import; a wheel carries it, an editable install does not
NAMES_PTH = ROOT / "integrations" / "optstate_hf_names" / "optstate_hf_names.pth"


def venv_python() -> Path:
    return VENV / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def ensure_env() -> Path:
    py = venv_python()
    stamp = VENV / ".optstate-stamp"
    want = hashlib.sha256((ROOT / "pyproject.toml").read_bytes() + CONSTRAINTS.read_bytes() + TORCH.encode()
                          + NAMES_PTH.read_bytes()).hexdigest()
    if py.exists() and stamp.exists() and stamp.read_text() == want:
        return py
    if not py.exists():
        print(f"[quickstart] creating {VENV}", flush=True)
        venv.EnvBuilder(with_pip=True).create(VENV)
    pip = [str(py), "-m", "pip", "install", "--disable-pip-version-check", "-q"]
    print(f"[quickstart] installing {TORCH} (CPU) and optstate[dev] pinned by constraints.txt", flush=True)
    subprocess.check_call(pip + [TORCH])
    subprocess.check_call(pip + ["-e", f"{ROOT}[dev]", "-c", str(CONSTRAINTS)])
    subprocess.check_call([str(py), "-m", "optstate_hf_names", "install"])  # the .pth into the venv (idempotent)
    stamp.write_text(want)
    return py


def main(argv) -> int:
    if not argv or argv[0] not in ("demo", "test"):
        print(__doc__)
        return 2
    py = str(ensure_env())
    if argv[0] == "demo":
        return subprocess.call([py, "-m", "optstate_core", "demo", *argv[1:]], cwd=ROOT)
    # one worker per core (pytest-xdist; an idle worker takes queued tests from a busy one), and
    # the 20 slowest tests at the end
    code = subprocess.call([py, "-m", "pytest", "-n", "auto", "--dist", "worksteal", "--durations=20", *argv[1:]],
                           cwd=ROOT)
    if code == 5:
        print("[quickstart] pytest collected no tests: treating that as a failure", flush=True)
        return 1
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
