"""No step reads memory it did not write: every preset trains bit for bit the same when torch fills
each new tensor with NaN (integers with their maximum), as ``torch.use_deterministic_algorithms``
does with ``torch.utils.deterministic.fill_uninitialized_memory`` (on by default). A read of an
unwritten buffer (a codec's padding, a scratch table, a staging copy) would change the run."""
import pytest
import torch

import optstate_core as oc
from helpers import local_tensors, mlp, train_steps, two_groups
from optstate_core.presets import PRESETS


def train(preset, filled, steps, **options):
    """Losses, parameters and state-dict tensors of ``steps`` steps on a small MLP (widths of 37:
    no block size divides them), under NaN fill or not."""
    import torch.utils.deterministic as det

    before = torch.are_deterministic_algorithms_enabled(), det.fill_uninitialized_memory
    torch.use_deterministic_algorithms(filled)
    det.fill_uninitialized_memory = True
    try:
        assert bool(torch.isnan(torch.empty(3)).all()) is filled  # the fill is on exactly when asked
        model = mlp(width=37)
        if preset.startswith("bf16w"):
            oc.cast_model(model)
        opt = oc.wrap(torch.optim.AdamW(two_groups(model)), preset, **options)
        losses = train_steps(model, opt, steps)
        return losses, [p.detach().clone() for p in model.parameters()], local_tensors(opt.state_dict())
    finally:
        torch.use_deterministic_algorithms(before[0])
        det.fill_uninitialized_memory = before[1]


def assert_same_run(a, b):
    assert a[0] == b[0]  # losses
    assert all(torch.equal(x, y) for x, y in zip(a[1], b[1]))  # parameters
    assert a[2].keys() == b[2].keys() and all(torch.equal(a[2][k], b[2][k]) for k in a[2])  # every state tensor


@pytest.mark.parametrize("release", [False, True], ids=["", "release"])
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_reference_step_reads_no_unwritten_memory(preset, release):
    # 12 steps: past every preset's warm-up, so the compressed codecs run
    assert_same_run(train(preset, False, 12, release_gradients=release),
                    train(preset, True, 12, release_gradients=release))


def test_fused_kernel_step_reads_no_unwritten_memory(monkeypatch):
    pytest.importorskip("triton")  # (under TRITON_INTERPRET=1 on the CPU)
    from optstate_core.step.fused_launch import KernelLauncher

    launched, real_run = [], KernelLauncher._run
    monkeypatch.setattr(KernelLauncher, "_run", lambda self, kernel, *a: (launched.append(kernel), real_run(self, kernel, *a)))
    options = dict(fused=True, release_gradients=True)
    plain = train("bf16w-4bit-lean", False, 2, **options)
    assert launched  # the update ran in the Triton kernels
    assert_same_run(plain, train("bf16w-4bit-lean", True, 2, **options))
