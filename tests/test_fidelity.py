"""Compressed presets train like AdamW: a 300-step run within 2%, and never NaN."""
import functools

import pytest
import torch

import optstate_core as oc


def teacher_student(policy, steps=300, lr=2e-3, seed=0, loss_scale=1.0, width=192, build=None):
    """Tail (last 50 steps) mean loss and the model. ``build(params, lr)`` makes the optimizer
    instead of wrapping AdamW with ``policy``."""
    torch.manual_seed(seed)
    teacher = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
    torch.manual_seed(seed + 1)
    model = torch.nn.Sequential(torch.nn.Linear(32, width), torch.nn.GELU(), torch.nn.Linear(width, width),
                                torch.nn.GELU(), torch.nn.Linear(width, 8))
    if build is not None:
        opt = build(model.parameters(), lr)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        if policy is not None:
            opt = oc.wrap(opt, policy)
    g = torch.Generator().manual_seed(123)
    losses = []
    for _ in range(steps):
        x = torch.randn(256, 32, generator=g)
        with torch.no_grad():
            y = teacher(x)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        (loss * loss_scale).backward()
        opt.step()
        losses.append(loss.item())
    return sum(losses[-50:]) / 50, model


@functools.lru_cache(maxsize=None)
def adamw_reference(steps, lr, loss_scale):
    return teacher_student(None, steps=steps, lr=lr, loss_scale=loss_scale)


POLICIES = {
    "8bit": lambda: oc.make_policy("8bit"),
    "4bit": lambda: oc.make_policy("4bit"),
    "4bit-all": lambda: oc.make_policy("4bit-all"),
    "low-memory-fp16": lambda: oc.make_low_memory_policy(warmup_steps=10),
}


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_300_steps_within_2_percent_of_adamw(name):
    ref, _ = adamw_reference(300, 2e-3, 1.0)
    got, _ = teacher_student(POLICIES[name]())
    assert abs(got / ref - 1) < 0.02, (got, ref)


def test_max_compression_is_int8_for_every_state_and_within_2_percent():
    """torch-optstate's wrap_max_compression_adamw: "int8-all state" from the first step."""
    ref, _ = adamw_reference(300, 2e-3, 1.0)
    opts = []

    def build(params, lr):
        opts.append(oc.wrap_max_compression_adamw(params, lr=lr, weight_decay=1e-2))
        return opts[-1]

    got, model = teacher_student(None, build=build)
    assert abs(got / ref - 1) < 0.02, (got, ref)
    assert opts[0].policy.warmup_steps == 0
    for p in model.parameters():  # biases included
        for key in ("exp_avg", "exp_avg_sq"):
            assert opts[0].state[p][key].codec.name == "int8", (tuple(p.shape), key)


@pytest.mark.parametrize("name", sorted(POLICIES) + ["offload", "bf16"])
def test_tiny_gradients_never_nan(name):
    """Fine-tuning-like: small lr and gradients ~1e-7, so exp_avg_sq ~1e-14 (fp16 flushes it to 0)."""
    policy = POLICIES[name]() if name in POLICIES else oc.make_policy(name)
    _, ref = adamw_reference(60, 1e-4, 1e-6)
    _, model = teacher_student(policy, steps=60, lr=1e-4, loss_scale=1e-6)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.isfinite(p).all()
    torch.manual_seed(1)
    start = torch.nn.Sequential(torch.nn.Linear(32, 192), torch.nn.GELU(), torch.nn.Linear(192, 192),
                                torch.nn.GELU(), torch.nn.Linear(192, 8))
    moved = sum((q - s).norm() ** 2 for q, s in zip(ref.parameters(), start.parameters())) ** 0.5
    off = sum((p - q).norm() ** 2 for p, q in zip(model.parameters(), ref.parameters())) ** 0.5
    assert off < 0.2 * moved  # the same trajectory as AdamW, up to the codecs' rounding
