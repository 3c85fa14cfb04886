"""(a) torchtitan's override mechanism swaps the optimizer config, and so the container it builds:
``--override.imports optstate_torchtitan.optstate_optimizers`` (with JSON keys), and a Python
config that uses the plugin's config directly (then ``--optimizer.optstate_*`` parse)."""
import pytest

pytest.importorskip("torchtitan.components.optimizer")  # a real torchtitan, not a folder of that name

import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402
from torchtitan.components.optimizer import OptimizersContainer, default_adamw  # noqa: E402
from torchtitan.config import apply_overrides  # noqa: E402
from torchtitan.config.manager import ConfigManager  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
import titan_lib as tl  # noqa: E402

import optstate_core as oc  # noqa: E402
from optstate_torchtitan import OptstateOptimizersContainer, optstate_optimizers  # noqa: E402

TARGET = "optstate_torchtitan.optstate_optimizers"


def parse(*args):
    """torchtitan's command line: registry config, tyro flags, then the override pass."""
    cfg = ConfigManager().parse_args(["--module", "titan_registry", *args])
    lines = apply_overrides(cfg.override, cfg) if cfg.override.imports else []
    return cfg, lines


def test_override_swaps_the_config_type_and_the_built_container():
    cfg, lines = parse("--config", "plain_adamw", "--override.imports", TARGET)
    assert type(cfg.optimizer) is OptstateOptimizersContainer.Config
    assert lines == [f"[Override] {TARGET}: optimizer OptimizersContainer.Config -> "
                     "OptstateOptimizersContainer.Config"]
    assert cfg.optimizer.param_groups == default_adamw(lr=1e-3).param_groups  # kept
    assert (cfg.optimizer.optstate_preset, cfg.optimizer.optstate_release_gradients) == ("8bit", False)
    cfg.optimizer.implementation = "for-loop"
    model = tl.build_model()
    optimizers = cfg.optimizer.build(model_parts=[model])
    assert type(optimizers) is OptstateOptimizersContainer and isinstance(optimizers, OptimizersContainer)
    assert len(optimizers) == 1 and all(type(o) is oc.VirtualOptimizer for o in optimizers)
    inner = optimizers.optimizers[0].optimizer
    assert type(inner) is torch.optim.AdamW and inner.param_groups[0]["betas"] == (0.9, 0.95)


def test_override_keys_from_the_command_line():
    keys = {"preset": "4bit", "release_gradients": True, "max_grad_norm": 0.5, "clip_mode": "per_tensor",
            "chunk_bytes": "8MB"}
    cfg, _ = parse("--config", "plain_adamw", "--override.imports", f"{TARGET}={json.dumps(keys)}")
    o = cfg.optimizer
    assert (o.optstate_preset, o.optstate_release_gradients, o.optstate_max_grad_norm, o.optstate_clip_mode,
            o.optstate_wrap_options) == ("4bit", True, 0.5, "per_tensor", {"chunk_bytes": "8MB"})
    model = tl.build_model()
    opt = o.build(model_parts=[model]).optimizers[0]
    assert opt.release_gradients and opt.max_grad_norm == 0.5 and opt.clip_mode == "per_tensor"
    model(tl.DATA[0][0]).sum().backward()  # released: the 4-bit state exists after backward
    assert opt.memory_report()["bits_per_param"] < 10


def test_a_config_written_for_the_plugin_takes_its_keys_as_flags():
    cfg, _ = parse("--config", "optstate_adamw", "--optimizer.optstate_preset", "bf16",
                   "--optimizer.optstate_release_gradients")  # a boolean is a flag (tyro)
    assert type(cfg.optimizer) is OptstateOptimizersContainer.Config
    assert (cfg.optimizer.optstate_preset, cfg.optimizer.optstate_release_gradients) == ("bf16", True)
    # the override on top of it keeps its keys and applies its own
    cfg, _ = parse("--config", "optstate_adamw", "--optimizer.optstate_preset", "bf16",
                   "--override.imports", f'{TARGET}={{"clip_mode": "previous"}}')
    assert (cfg.optimizer.optstate_preset, cfg.optimizer.optstate_clip_mode) == ("bf16", "previous")


def test_the_real_trainer_config_is_swapped():
    trainer = pytest.importorskip("torchtitan.trainer", reason="torchtitan.trainer imports triton")
    cfg = trainer.Trainer.Config()
    cfg.override.imports = [TARGET]
    apply_overrides(cfg.override, cfg)
    assert type(cfg.optimizer) is OptstateOptimizersContainer.Config


def test_bad_settings_fail_at_build_with_the_reason():
    model = tl.build_model()
    with pytest.raises(ValueError, match="unknown preset 'int3'"):
        optstate_optimizers(default_adamw(), preset="int3").build(model_parts=[model])
    cfg = optstate_optimizers(default_adamw())
    cfg.implementation = "fused_opt_states_bf16"
    with pytest.raises(ValueError, match="fused_opt_states_bf16"):
        cfg.build(model_parts=[model])
    with pytest.raises(TypeError, match="config fields"):
        optstate_optimizers(default_adamw(), implementation="foreach")
