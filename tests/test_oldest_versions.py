"""tools/oldest_versions.py: the pins CI's oldest-versions job installs come from pyproject's floors."""
from pathlib import Path

import pytest

import helpers

ROOT = Path(__file__).resolve().parents[1]


def load_tool():
    return helpers.load_tool("oldest_versions")


def test_pins_every_framework_floor_of_pyproject():
    tool = load_tool()
    pins = tool.oldest_constraints(tool.load_extras(ROOT / "pyproject.toml"))
    names = {line.split("==")[0] for line in pins}
    assert {"transformers", "accelerate", "lightning", "pytorch-lightning", "peft", "trl"} <= names
    assert "torch" not in names and all(line.endswith(".*") for line in pins)


def test_pins_and_errors():
    tool = load_tool()
    extras = {"hf": ["transformers>=4.48", "accelerate>=1.0"], "lightning": ["lightning>=2.4"],
              "accelerate": ["accelerate>=1.0"], "finetune": ["peft>=0.14"]}
    assert tool.oldest_constraints(extras) == ["accelerate==1.0.*", "lightning==2.4.*", "peft==0.14.*",
                                               "pytorch-lightning==2.4.*", "transformers==4.48.*"]
    with pytest.raises(ValueError, match="not of the form name>=X.Y"):
        tool.oldest_constraints({**extras, "finetune": ["peft"]})
    with pytest.raises(ValueError, match="two floors"):
        tool.oldest_constraints({**extras, "accelerate": ["accelerate>=1.1"]})
    with pytest.raises(ValueError, match="no optional-dependencies extra 'finetune'"):
        tool.oldest_constraints({k: v for k, v in extras.items() if k != "finetune"})
