"""A stand-in for a torchtitan ``config_registry`` module (``--module titan_registry --config ...``).

torchtitan's ``Trainer`` module imports triton (its MoE kernels), which CPU-only torch does not
bring, so the root config here is a small ``Configurable.Config`` with the trainer's fields that
the CLI parser and the override pass read: ``hf_assets_path``, ``optimizer``, ``override``."""
from dataclasses import dataclass, field

from torchtitan.components.optimizer import OptimizersContainer, default_adamw
from torchtitan.config import Configurable, OverrideConfig

from optstate_torchtitan import optstate_optimizers


@dataclass(kw_only=True, slots=True)
class Root(Configurable.Config):
    hf_assets_path: str = "."
    optimizer: OptimizersContainer.Config = field(default_factory=OptimizersContainer.Config)
    override: OverrideConfig = field(default_factory=OverrideConfig)


def plain_adamw() -> Root:
    """A config as torchtitan's registries write it: the stock container."""
    return Root(optimizer=default_adamw(lr=1e-3))


def optstate_adamw() -> Root:
    """A config written for the plugin: its container from the start (CLI keys then parse)."""
    return Root(optimizer=optstate_optimizers(default_adamw(lr=1e-3), preset="8bit"))
