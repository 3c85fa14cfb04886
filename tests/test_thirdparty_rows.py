"""A test per row of docs/compatibility-thirdparty.md: every third-party optimizer ``optstate compat
--thirdparty`` discovers, wrapped with ``fp32``, trains bit for bit as unwrapped (its groups, its
train()/eval() included) on the compat task, and with ``8bit`` it steps to a finite loss, or ``wrap``
refuses it with the reason; the ones discovery skips are skipped here with the same reason. Cheap: 3
steps, one seed."""
import math

import pytest
import torch

from optstate_core.apps import compat, thirdparty

pytest.importorskip("pytorch_optimizer")
ENTRIES = {e.name: e for e in thirdparty.discover(probe=False)}


@pytest.mark.parametrize("name", sorted(ENTRIES))
def test_row(name):
    (entry,) = thirdparty.discover([name])
    if entry.skip is not None:
        pytest.skip(entry.skip)
    base = compat.run_one(name, None, 0, 3, factory=entry.factory, bias=entry.bias)
    try:
        exact = compat.run_one(name, "fp32", 0, 3, factory=entry.factory, bias=entry.bias)
    except ValueError as e:  # refused at wrap, with its reason (the table's "no: ..." rows)
        assert "cannot be wrapped" in str(e), str(e)
        return
    assert all(torch.equal(p, q) for p, q in zip(base.params, exact.params))
    compressed = compat.run_one(name, "8bit", 0, 3, factory=entry.factory, bias=entry.bias)
    assert math.isfinite(compressed.loss)
