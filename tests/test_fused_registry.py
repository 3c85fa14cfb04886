"""The fused optimizers' registry: the entry for an inner optimizer, each entry's state keys and
refusals, the codecs' kernel forms, and the fallback of an optimizer without an entry."""
import dataclasses
import logging

import pytest
import torch

import optstate_core as oc
from optstate_core.state.codecs import (BF16Codec, Float24Codec, FP16Codec, FP32Codec, Int4Codec, Int8Codec,
                                        StateKind)
from optstate_core.step.fused_optimizers import ENTRIES, FusedPlan, entry_for, no_kernel
from optstate_core.step.gradients import collect

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the suite's TRITON_INTERPRET=1
KEYS = {"adam": ("exp_avg", "exp_avg_sq"), "sgd": ("momentum_buffer",), "lion": ("exp_avg",),
        "schedule_free": ("z", "exp_avg_sq")}
ENTRY = {e.name: e for e in ENTRIES}


def test_each_entry_declares_its_state_keys():
    assert {e.name: e.keys for e in ENTRIES} == KEYS
    assert ENTRY["adam"].state_keys({"amsgrad": True}) == KEYS["adam"] + ("max_exp_avg_sq",)
    assert ENTRY["sgd"].state_keys({"momentum": 0.9}) == KEYS["sgd"]


def test_the_registry_finds_the_entry_of_exactly_its_classes():
    ps = [torch.nn.Parameter(torch.zeros(2))]

    class OwnAdam(torch.optim.Adam):  # a subclass may change the update: no entry
        pass
    assert entry_for(torch.optim.Adam(ps)) is entry_for(torch.optim.AdamW(ps)) is ENTRY["adam"]
    assert entry_for(torch.optim.SGD(ps, lr=0.1)) is ENTRY["sgd"]
    assert entry_for(OwnAdam(ps)) is None and entry_for(torch.optim.NAdam(ps)) is None
    assert no_kernel(torch.optim.NAdam(ps)) == "NAdam has no fused kernel (Adam, AdamW, SGD and lion-pytorch's Lion do)"


def test_refusals_and_kernel_forms_are_each_entrys():
    ps = [torch.nn.Parameter(torch.zeros(2))]
    sgd = torch.optim.SGD(ps, lr=0.1)
    assert ENTRY["sgd"].refusal(sgd, sgd.param_groups[0]) == "SGD without momentum has no state to compress"
    momentum = torch.optim.SGD(ps, lr=0.1, momentum=0.9)
    assert ENTRY["sgd"].refusal(momentum, momentum.param_groups[0]) is None
    assert ENTRY["lion"].refusal(sgd, {"lr": torch.tensor(0.1)}) == "SGD with a tensor lr"
    assert ENTRY["schedule_free"].refusal(sgd, {"lr": 0.1}) is None
    S = StateKind
    assert ENTRY["adam"].allows((S.INT8, S.INT4, S.BF16)) and not ENTRY["adam"].allows((S.FP32, S.FP24))
    assert ENTRY["schedule_free"].allows((S.FP24, S.INT4)) and ENTRY["schedule_free"].allows((S.BF16, S.INT8))
    assert not ENTRY["schedule_free"].allows((S.INT8, S.INT8)) and not ENTRY["schedule_free"].allows((S.FP32, S.FP24))


def test_each_codec_says_its_kernel_form():
    forms = [FP32Codec(), BF16Codec(), Int8Codec(), Int4Codec(), Float24Codec()]
    assert [c.kernel_form for c in forms] == list(StateKind)
    assert [c.kernel_form for c in (Int8Codec(block_size=128), Int8Codec(exp_bits=3), Int4Codec(block_size=64),
                                    FP16Codec(), oc.get_codec("corr16"))] == [None] * 5
    assert Int4Codec().kernel_constants() == (15, 0.5, 2) and Int8Codec().kernel_constants() == (2, 0.5, 0)


def _work(opt):
    (w,) = collect(opt._engine.param_infos(), opt._engine.state)
    return w


def _wrapped(cls, **kw):
    ps = [torch.nn.Parameter(torch.randn(4, 256, device=DEVICE))]
    ps[0].grad = torch.randn(4, 256, device=DEVICE)
    policy = oc.WarmupPolicy(warmup_steps=0, momentum_codec="int8", variance_codec="int8", min_int8_elements=0,
                             whole_blocks_1d=False)
    return oc.wrap(cls(ps, **kw), policy, fused=True)


def test_an_optimizer_without_an_entry_falls_back_with_its_reason(caplog):
    pytest.importorskip("triton")
    opt = _wrapped(torch.optim.NAdam)
    with caplog.at_level(logging.INFO, logger="optstate"):
        assert opt._engine.fused.plan(_work(opt)) is None
    assert "reference path (not the fused kernel) because NAdam has no fused kernel (Adam, AdamW, SGD and " \
           "lion-pytorch's Lion do)" in caplog.text


def test_the_plan_is_a_frozen_record_of_its_entry():
    pytest.importorskip("triton")
    opt = _wrapped(torch.optim.AdamW, lr=1e-3)
    plan = opt._engine.fused.plan(_work(opt))
    assert isinstance(plan, FusedPlan) and plan.optimizer is ENTRY["adam"] and plan.kind == "adam"
    assert plan.keys == KEYS["adam"] and plan.kinds == (StateKind.INT8, StateKind.INT8) and plan.first
    assert not plan.offload and plan.host == (False, False) and plan.master == 0 and not plan.torch_fused
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.first = False
