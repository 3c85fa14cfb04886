"""examples/peft_lora_finetune.py and examples/trl_sft_finetune.py run end to end."""
import importlib.util
from pathlib import Path

import pytest

from hf_testlib import one_thread  # noqa: F401  (the examples set one thread; the fixture restores it)

pytestmark = pytest.mark.usefixtures("one_thread")
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def run_example(name, argv):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(argv)


@pytest.mark.parametrize("name, package, codec", [("peft_lora_finetune", "peft", "int8"),
                                                  ("trl_sft_finetune", "trl", "int4")])
def test_example_trains_the_adapters_with_compressed_state(capsys, name, package, codec):
    pytest.importorskip(package)
    result = run_example(name, ["--steps", "8"])
    out = capsys.readouterr().out
    assert "optimizer state covers" in out
    report = result["report"]
    assert report["n_params"] == result["n_adapter"] > 0
    assert set(report["by_codec"]) == {codec}
    assert report["state_bytes"] < 8 * result["n_adapter"] / 3
    assert result["losses"][-1] < result["losses"][0]
