"""Print pip constraints that pin each framework pyproject.toml supports to its oldest allowed minor.

    python tools/oldest_versions.py > oldest.txt
    pip install torch==2.13.0 && pip install -e ".[dev]" -c oldest.txt

For every requirement ``name>=X.Y`` in the extras named in ``FRAMEWORK_EXTRAS`` it prints
``name==X.Y.*`` (the newest patch release of the oldest supported minor), so CI's oldest-versions
job checks exactly the floors that pyproject.toml claims. ``lightning`` also pins
``pytorch-lightning``, which it depends on at the same version.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

FRAMEWORK_EXTRAS = ("hf", "lightning", "accelerate", "finetune")
SAME_VERSION = {"lightning": ("pytorch-lightning",)}
_FLOOR = re.compile(r"^\s*([A-Za-z0-9_.\-]+)\s*>=\s*([0-9]+(?:\.[0-9]+)*)\s*$")


def load_extras(pyproject: Path) -> dict:
    import tomllib  # Python >= 3.11

    return tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"]


def oldest_constraints(extras: dict) -> list:
    """``name==X.Y.*`` lines for every framework floor; a requirement without one is an error."""
    pins = {}
    for extra in FRAMEWORK_EXTRAS:
        if extra not in extras:
            raise ValueError(f"pyproject.toml has no optional-dependencies extra {extra!r}")
        for requirement in extras[extra]:
            match = _FLOOR.match(requirement)
            if match is None:
                raise ValueError(f"extra {extra!r}: {requirement!r} is not of the form name>=X.Y")
            name, floor = match.group(1).lower(), match.group(2)
            if pins.get(name, floor) != floor:
                raise ValueError(f"{name} has two floors in pyproject.toml: {pins[name]} and {floor}")
            pins[name] = floor
            for twin in SAME_VERSION.get(name, ()):
                pins[twin] = floor
    return [f"{name}=={floor}.*" for name, floor in sorted(pins.items())]


def main() -> int:
    root = Path(__file__).resolve().parent.parent
    print("\n".join(oldest_constraints(load_extras(root / "pyproject.toml"))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
