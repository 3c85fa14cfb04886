"""bf16 parameters with master weights as state train like AdamW on fp32 parameters.

A teacher-student regression (bf16 forward and backward for the bf16 models): with master weights
(``bf16w-*`` presets) the last-50-step mean loss is within 3% of fp32 AdamW's; plain bf16
parameters with AdamW (no master) lose small updates to bf16 rounding and end far worse at a
small learning rate, which is what the correction prevents.
"""
import functools

import pytest
import torch

import optstate_core as oc


def teacher_student(preset, steps=300, lr=2e-3, seed=0, bf16=False, width=192):
    torch.manual_seed(seed)
    teacher = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
    torch.manual_seed(seed + 1)
    model = torch.nn.Sequential(torch.nn.Linear(32, width), torch.nn.GELU(), torch.nn.Linear(width, width),
                                torch.nn.GELU(), torch.nn.Linear(width, 8))
    if bf16:
        oc.cast_model(model)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    if preset is not None:
        opt = oc.wrap(opt, preset)
    g = torch.Generator().manual_seed(123)
    losses = []
    dtype = torch.bfloat16 if bf16 else torch.float32
    for _ in range(steps):
        x = torch.randn(256, 32, generator=g)
        with torch.no_grad():
            y = teacher(x)
        loss = torch.nn.functional.mse_loss(model(x.to(dtype)).float(), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return sum(losses[-50:]) / 50


@functools.lru_cache(maxsize=None)
def fp32_adamw(lr):
    return teacher_student(None, lr=lr)


@pytest.mark.parametrize("preset", ["bf16w-8bit", "bf16w-4bit-lean"])
def test_master_weight_presets_track_fp32_adamw(preset):
    ref = fp32_adamw(2e-3)
    got = teacher_student(preset, bf16=True)
    assert abs(got / ref - 1) < 0.03, (got, ref)


def test_without_master_weights_bf16_stalls_at_small_lr():
    lr = 2e-4
    ref = fp32_adamw(lr)
    master = teacher_student("bf16w-8bit", lr=lr, bf16=True)
    plain = teacher_student(None, lr=lr, bf16=True)
    assert abs(master / ref - 1) < 0.03, (master, ref)
    assert plain > 1.1 * master, (plain, master)
