"""Benchmark contenders (apps/contenders.py): further wrap() options reach optstate's optimizer only."""
import pytest
import torch

from optstate_core.apps import contenders


def params():
    return [torch.nn.Parameter(torch.zeros(8, 256))]


def test_wrap_options_reach_an_optstate_contender():
    c = contenders.parse("bf16w-4bit-lean-offload+release")
    opt = contenders.build(c, params(), max_grad_norm=1.0, release_bucket_bytes=12345, prefetch_budget=0)
    assert opt._engine.clip_release.bucket_bytes == 12345
    assert opt._engine.schedule.area.budget == 0
    opt.close()


def test_wrap_options_are_refused_for_other_optimizers():
    with pytest.raises(ValueError, match=r"\['prefetch_budget'\].*adamw is not an optstate contender"):
        contenders.build(contenders.parse("adamw"), params(), prefetch_budget=0)


def test_an_unknown_wrap_option_is_refused_by_wrap():
    with pytest.raises(TypeError, match="no_such_option"):
        contenders.build(contenders.parse("4bit"), params(), no_such_option=1)
