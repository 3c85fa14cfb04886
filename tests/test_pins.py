"""constraints.txt pins every package the test run installs beside torch: the closure of
``optstate[dev]``'s requirements in this environment (the frameworks, the third-party optimizers,
pytest and its plugins, and what they pull in) has a pin for each distribution."""
from importlib import metadata
from pathlib import Path

import pytest

packaging = pytest.importorskip("packaging.requirements")
ROOT = Path(__file__).resolve().parent.parent
NOT_PINNED = {"torch", "optstate"}  # torch is pinned by OPTSTATE_TORCH; optstate is the project


def canonical(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def pins() -> dict:
    out = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"constraints.txt: {line!r} is not an exact pin"
            out[canonical(name)] = version
    return out


def requirement_closure(name: str, extras: set) -> set:
    """Distributions ``name[extras]`` needs in this environment, itself included."""
    seen, todo = set(), [(name, frozenset(extras))]
    while todo:
        dist_name, dist_extras = todo.pop()
        key = (canonical(dist_name), dist_extras)
        if key in seen:
            continue
        seen.add(key)
        for text in metadata.distribution(dist_name).requires or []:
            req = packaging.Requirement(text)
            if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in dist_extras | {""}):
                todo.append((req.name, frozenset(req.extras)))
    return {name for name, _ in seen}


def test_every_test_dependency_is_pinned():
    try:
        metadata.distribution("optstate")
    except metadata.PackageNotFoundError:
        pytest.skip("optstate is not installed in this environment (pip install -e .[dev])")
    needed = requirement_closure("optstate", {"dev"})
    torch_needs = requirement_closure("torch", set())  # installed with torch itself, before the pins
    missing = sorted(needed - torch_needs - NOT_PINNED - set(pins()))
    assert not missing, f"constraints.txt lacks pins for {missing} (python3 tools/update_pins.py)"
    assert {"transformers", "accelerate", "lightning", "peft", "trl", "heavyball", "pytest-xdist"} <= set(pins())


def test_the_pins_are_exact_and_leave_torch_to_its_own_setting():
    table = pins()
    assert "torch" not in table and len(table) >= 20
