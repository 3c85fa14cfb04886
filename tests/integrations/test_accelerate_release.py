"""Accelerate with gradient release: clip_grad_norm_ calls are routed to the optimizer's clipping."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("accelerate")
from accelerate import Accelerator  # noqa: E402
from accelerate_testlib import fresh_accelerate, reset_accelerate  # noqa: E402,F401

import optstate_accelerate as osa  # noqa: E402
import optstate_core as oc  # noqa: E402
from helpers import batch, flat_params, mlp  # noqa: E402



def _run(release: bool, clip_calls: bool, micro_batches: int = 6):
    reset_accelerate()
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = mlp(0)
    opt = oc.wrap(torch.optim.AdamW(model.parameters(), lr=1e-2), oc.make_policy("8bit", min_int8_elements=256),
                  release_gradients=release, clip_mode="per_tensor", max_grad_norm=None if release else 0.05)
    model, popt = accelerator.prepare(model, opt)
    attachment = osa.attach(accelerator, popt, max_grad_norm=0.05 if release else None)
    norms = []
    for i in range(micro_batches):
        x, y = batch(100 + i)
        with accelerator.accumulate(model):
            accelerator.backward(F.cross_entropy(model(x) * 30, y))
            if accelerator.sync_gradients and clip_calls:
                norms.append(float(accelerator.clip_grad_norm_(model.parameters(), 0.05)))
            popt.step()
            popt.zero_grad()
    return accelerator, model, opt, attachment, norms


def test_clip_grad_norm_is_routed_and_matches_clipping_in_step():
    acc, model, opt, attachment, norms = _run(release=True, clip_calls=True)
    _, ref_model, ref, _, _ = _run(release=False, clip_calls=False)
    assert opt.step_count == ref.step_count == 3
    assert torch.equal(flat_params(model), flat_params(ref_model))  # accumulation kept, clipping applied
    assert len(norms) == 3 and all(n > 0.05 for n in norms)
    attachment.detach()
    assert "clip_grad_norm_" not in acc.__dict__  # the accelerator's own method again


def test_clipping_that_cannot_be_routed_raises():
    acc, model, opt, _, _ = _run(release=True, clip_calls=False, micro_batches=2)
    with pytest.raises(ValueError, match="max_norm=1.0"):
        acc.clip_grad_norm_(model.parameters(), 1.0)
    with pytest.raises(ValueError, match="norm_type"):
        acc.clip_grad_norm_(model.parameters(), 0.05, norm_type=1)
    opt.max_grad_norm = None
    with pytest.raises(ValueError, match="set beforehand"):
        acc.clip_grad_norm_(model.parameters(), 0.05)


@pytest.mark.parametrize("release", [True, False])
def test_attached_optimizer_model_and_accelerator_are_freed_when_dropped(release):
    """attach() keeps no strong reference: once the caller drops the accelerator, model and optimizer,
    they are garbage (the 8B example trains several models in one process)."""
    import gc
    import weakref
    acc, model, opt, attachment, _ = _run(release=release, clip_calls=False, micro_batches=2)
    refs = [weakref.ref(x) for x in (acc, model, opt)]
    assert osa.attach(acc, opt) is not None  # attaching again (the previous attachment detached) keeps nothing either
    del acc, model, opt, attachment
    reset_accelerate()
    gc.collect()
    assert [r() for r in refs] == [None, None, None]
