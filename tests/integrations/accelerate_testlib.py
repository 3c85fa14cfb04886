"""Accelerate test helpers: its process-wide state singletons reset around each test."""
import pytest

pytest.importorskip("accelerate")

from accelerate.state import AcceleratorState, GradientState  # noqa: E402


def reset_accelerate() -> None:
    """AcceleratorState, PartialState and GradientState are process-wide singletons."""
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


@pytest.fixture(autouse=True)
def fresh_accelerate():
    """Autouse in the modules that import it: every test starts and ends with fresh state."""
    reset_accelerate()
    yield
    reset_accelerate()
