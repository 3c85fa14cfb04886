"""Gradient release: updates in backward match step(), gradients are freed at once, clipping modes."""
import copy

import pytest
import torch

import optstate_core as oc
from optstate_core.state.master_weights import cast_model
from helpers import mlp

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.LayerNorm(64), torch.nn.Linear(64, 64),
                               torch.nn.Tanh(), torch.nn.Linear(64, 4))


def _model_for(preset):
    """``_model()`` and its input dtype: bf16 weights (masters as state) for the ``bf16w-*`` presets."""
    model = _model()
    if preset.startswith("bf16w"):
        cast_model(model)
        return model, torch.bfloat16
    return model, torch.float32


def _batches(n, seed=1, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(8, 32, generator=g).to(dtype) for _ in range(n)]


def _run(model, opt, batches, accumulate=1, release=False):
    """Training loop with accumulation; returns the most gradient bytes alive at once in backward
    on boundary micro-batches (seen from a hook that runs after the release hook)."""
    alive = []
    params = list(model.parameters())

    def count(_):
        alive.append(sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None))

    handles = [p.register_post_accumulate_grad_hook(count) for p in params]
    for i, x in enumerate(batches):
        boundary = (i + 1) % accumulate == 0
        opt.set_step_boundary(boundary)
        before = len(alive)
        model(x).float().pow(2).mean().backward()
        if boundary:
            if release:
                assert all(p.grad is None for p in params)
            snapshot = [p.detach().clone() for p in params]
            opt.step()
            if release:  # step() only advances: no second update
                assert all(torch.equal(a, p) for a, p in zip(snapshot, params))
            opt.zero_grad()
        else:
            assert all(p.grad is not None for p in params)
            alive[before:] = []
    for h in handles:
        h.remove()
    return max(alive, default=0)


@pytest.mark.parametrize("preset,accumulate,bucket", [("fp32", 2, 0), ("8bit", 1, 0), ("8bit", 1, 16384),
                                                      ("8bit", 1, None), ("bf16w-4bit-lean", 2, 16384),
                                                      ("bf16w-8bit", 1, 0)])
def test_release_matches_step_and_frees_gradients(preset, accumulate, bucket):
    """Released, the run equals step() bit for bit, and gradients are freed as they are updated:
    with ``release_bucket_bytes=0`` each in its own hook (none outlives its hook), with a bucket
    in batches of fewer pending bytes than the bucket, by default at the end of backward at the
    latest (no gradient is left when backward returns: asserted in ``_run``)."""
    batches = _batches(6)
    results = []
    for release in (False, True):
        model, dtype = _model_for(preset)
        options = {} if bucket is None or not release else {"release_bucket_bytes": bucket}
        opt = oc.wrap(torch.optim.AdamW(model.parameters(), lr=1e-2), preset, release_gradients=release, **options)
        peak = _run(model, opt, [b.to(dtype) for b in batches], accumulate=accumulate, release=release)
        results.append((model, opt, peak))
    (m0, o0, peak0), (m1, o1, peak1) = results
    assert peak0 == sum(p.numel() * p.element_size() for p in m0.parameters())
    if accumulate == 1 and bucket is not None:  # accumulated gradients live until the boundary
        assert peak1 == 0 if bucket == 0 else 0 < peak1 < bucket
    assert o0.step_count == o1.step_count == 6 // accumulate
    for p, q in zip(m0.parameters(), m1.parameters()):
        assert torch.equal(p, q)
    s0, s1 = o0.state_dict(), o1.state_dict()
    assert s0["optstate"]["step"] == s1["optstate"]["step"]
    assert torch.equal(torch.as_tensor(s0["state"][0]["step"]), torch.as_tensor(s1["state"][0]["step"]))


@pytest.mark.parametrize("max_grad_norm", [None, 0.05])
def test_release_checkpoint_resume_and_nan_skip(max_grad_norm):
    """A resumed run equals the uninterrupted one, with clipping by the previous step's norm too
    (the checkpoint carries that norm: a clip at 0.05 scales every step's gradients)."""
    model = _model()
    opt = oc.wrap(torch.optim.AdamW(model.parameters(), lr=1e-2), "8bit", release_gradients=True,
                  max_grad_norm=max_grad_norm)
    _run(model, opt, _batches(2), release=True)
    saved = copy.deepcopy(opt.state_dict())
    assert ("last_grad_norm" in saved["optstate"]["clip"]) and float(opt.last_grad_norm) > 0.05
    model2 = copy.deepcopy(model)
    opt2 = oc.wrap(torch.optim.AdamW(model2.parameters(), lr=1e-2), "8bit", release_gradients=True,
                   max_grad_norm=max_grad_norm)
    opt2.load_state_dict(saved)
    for m, o in ((model, opt), (model2, opt2)):
        _run(m, o, _batches(2, seed=5), release=True)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), model2.parameters()))
    # a NaN gradient: without clipping that parameter is skipped and the others are updated; with
    # clipping by the exact global norm (one batch holds the step) it makes the norm NaN and every
    # parameter is skipped, as global clipping without release does; the step counts either way
    first = model[0].weight
    before = [p.detach().clone() for p in model.parameters()]
    norm_before = opt.last_grad_norm.clone()
    first.register_hook(lambda g: torch.full_like(g, float("nan")))
    _run(model, opt, _batches(1, seed=7), release=True)
    after = list(model.parameters())
    assert torch.equal(before[0], after[0]) and torch.equal(before[2], after[2]) == (max_grad_norm is not None)
    assert opt.memory_report()["nonfinite_skipped"] >= 1
    assert torch.isfinite(opt.last_grad_norm) and (max_grad_norm is None or torch.equal(opt.last_grad_norm,
                                                                                          norm_before))


def test_a_bad_clip_state_in_a_checkpoint_changes_nothing():
    model = _model()
    opt = oc.wrap(torch.optim.AdamW(model.parameters(), lr=1e-2), "8bit", release_gradients=True, max_grad_norm=1.0)
    _run(model, opt, _batches(1), release=True)
    saved = copy.deepcopy(opt.state_dict())
    before = copy.deepcopy(opt.state_dict())
    for bad in ({"last_grad_norm": "big"}, {"last_grad_norm": -1.0}, [1.0]):
        sd = copy.deepcopy(saved)
        sd["optstate"]["clip"] = bad
        with pytest.raises(ValueError, match="clip state"):
            opt.load_state_dict(sd)
        assert opt.state_dict()["optstate"] == before["optstate"]


def _clip_reference(model, opt_cls, batches, rule):
    """Plain AdamW with a hand-written clipping rule(grads, step index, previous norm)."""
    opt = opt_cls(model.parameters(), lr=1e-2)
    previous = None
    for i, x in enumerate(batches):
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        grads = [p.grad for p in model.parameters()]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
        rule(grads, previous)
        previous = norm
        opt.step()


def test_clip_modes_match_their_definitions():
    batches = [b * 30 for b in _batches(4)]  # large gradients: clipping is active
    max_norm = 0.05

    def per_tensor(grads, previous):
        for g in grads:
            g.mul_(torch.clamp(max_norm / (torch.linalg.vector_norm(g) + 1e-6), max=1.0))

    def previous_global(grads, previous):
        if previous is None:
            return per_tensor(grads, None)
        for g in grads:
            g.mul_(torch.clamp(max_norm / (previous + 1e-6), max=1.0))

    def global_(grads, previous):
        torch.nn.utils.clip_grad_norm_(grads and [p for p in ref.parameters()], max_norm)

    # "previous" with one update per hook is the previous step's norm, "auto" per tensor; with the
    # default batch, which holds this small model's every gradient at the end of backward, both
    # clip by the exact global norm
    for mode, rule, release, bucket in (("per_tensor", per_tensor, True, None),
                                        ("previous", previous_global, True, 0), ("previous", global_, True, None),
                                        ("auto", per_tensor, True, 0), ("auto", global_, True, None),
                                        ("global", global_, False, None), ("per_tensor", per_tensor, False, None)):
        ref = _model()
        _clip_reference(ref, torch.optim.AdamW, batches, rule)
        model = _model()
        options = {} if bucket is None else {"release_bucket_bytes": bucket}
        opt = oc.wrap(torch.optim.AdamW(model.parameters(), lr=1e-2), "fp32", release_gradients=release,
                      max_grad_norm=max_norm, clip_mode=mode, **options)
        _run(model, opt, batches, release=release)
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=f"{mode}, release={release}, bucket={bucket}")
        assert opt.last_grad_norm is not None and opt.last_grad_norm > max_norm


@pytest.mark.parametrize("preset", ["fp32", "8bit", "bf16w-4bit-lean"])
def test_release_with_clipping_equals_global_clipping_when_one_batch_holds_the_step(preset):
    """Clipping is active every step; the default batch holds every gradient of this model at the
    end of backward, so release clips by the exact global norm: bit for bit the run without
    release that clips with torch's clip_grad_norm_ after backward (and the same norm)."""
    batches = [b * 30 for b in _batches(4)]
    runs = []
    for release in (False, True):
        model, dtype = _model_for(preset)
        opt = oc.wrap(torch.optim.AdamW(model.parameters(), lr=1e-2), preset, release_gradients=release,
                      max_grad_norm=0.05)
        _run(model, opt, [b.to(dtype) for b in batches], release=release)
        runs.append((model, opt))
    (m0, o0), (m1, o1) = runs
    assert o0._engine.clip_release.clip_mode == "global" and o1._engine.clip_release.clip_mode == "auto"
    assert torch.equal(o0.last_grad_norm, o1.last_grad_norm) and float(o1.last_grad_norm) > 0.05
    for p, q in zip(m0.parameters(), m1.parameters()):
        assert torch.equal(p, q)


# per tensor: every state kind and gradient dtype; by the previous norm (the same folded factor,
# computed a step earlier): one compressed-moment preset, one master-weight preset, fp16 gradients
_CLIP_CASES = ([(preset, dtype, "per_tensor", False) for preset, dtype in (
                   ("8bit", torch.float32), ("4bit", torch.float32), ("bf16w-4bit-lean", None), ("bf16w-8bit", None),
                   ("8bit", torch.float16))]
               + [(preset, dtype, "previous", False) for preset, dtype in (
                   ("8bit", torch.float32), ("bf16w-4bit-lean", None), ("8bit", torch.float16))])


@pytest.mark.parametrize("preset,dtype,mode,nan", _CLIP_CASES + [("bf16w-4bit-lean", None, "per_tensor", True),
                                                                 ("8bit", torch.float32, "previous", True)])
def test_release_clips_inside_the_fused_launch_bit_for_bit(preset, dtype, mode, nan, monkeypatch):
    """Released batches on the fused path are clipped as the kernels read their gradients (no pass
    over them): bit for bit the same run with each gradient scaled in place first, for fp32, bf16
    and fp16 gradients, per tensor and by the previous step's norm; per tensor also bit for bit
    the run without release that clips in step(). ``nan``: one step's first-layer gradient is
    NaN (its norm and factor too): the same parameters are skipped. (On CUDA when there is one:
    the kernels' own rounding.)"""
    from optstate_core.schedule.release import ClipAndRelease
    from optstate_core.step.fused_launch import KernelLauncher

    batches = [b * 30 for b in _batches(4)]  # large gradients: clipping is active
    folded = []
    launch = KernelLauncher.launch

    def counting_launch(self, bucket, *args, **kwargs):
        folded.append(self._factors is not None)
        return launch(self, bucket, *args, **kwargs)

    monkeypatch.setattr(KernelLauncher, "launch", counting_launch)
    clip = ClipAndRelease._clip
    runs = []
    for release, fold in ((True, True), (True, False), (False, False)):
        if not fold:  # every gradient scaled in place by _clip, none by the kernels
            monkeypatch.setattr(ClipAndRelease, "_clip", lambda self, grads, fold=None: clip(self, grads))
        model, weights = _model_for(preset)
        model = model.to(DEVICE, dtype)
        if nan:
            calls = []  # the third backward's gradient only

            def third_is_nan(g):
                calls.append(1)
                return g.fill_(float("nan")) if len(calls) == 3 else g

            model[0].weight.register_hook(third_is_nan)
        folded.clear()
        opt = oc.wrap(torch.optim.AdamW(model.parameters(), lr=1e-2), preset, fused=True, release_gradients=release,
                      max_grad_norm=0.05, clip_mode=mode, **({"release_bucket_bytes": 4096} if release else {}))
        _run(model, opt, [b.to(DEVICE, dtype or weights) for b in batches], release=release)
        assert any(folded) == fold and len(folded) > 4  # several batches, each launched
        runs.append((model, opt.memory_report()["nonfinite_skipped"]))
    for other in (runs[1], runs[2]) if mode == "per_tensor" else (runs[1],):
        assert other[1] == runs[0][1] == (1 if nan else 0)
        for p, q in zip(runs[0][0].parameters(), other[0].parameters()):
            assert torch.equal(p, q)


def test_step_after_a_released_backward_reuses_its_plan(monkeypatch):
    """step() after a released backward has no gradient left to plan for: it plans once, then
    reuses that (empty) plan each step instead of planning every parameter afresh."""
    from optstate_core.schedule.engine import Engine

    planned = []
    plan_and_run = Engine._plan_and_run
    monkeypatch.setattr(Engine, "_plan_and_run", lambda self, sig: planned.append(1) or plan_and_run(self, sig))
    model = _model()
    opt = oc.wrap(torch.optim.AdamW(model.parameters(), lr=1e-2), "8bit", fused=True, release_gradients=True,
                  max_grad_norm=0.05, release_bucket_bytes=4096)
    _run(model, opt, [b * 30 for b in _batches(4)], release=True)
    assert opt.step_count == 4 and len(planned) == 1


def test_release_and_clip_options_are_validated():
    params = list(_model().parameters())
    with pytest.raises(ValueError, match="clip_mode='global'"):
        oc.wrap(torch.optim.AdamW(params), "fp32", release_gradients=True, clip_mode="global")
    with pytest.raises(ValueError, match="max_grad_norm"):
        oc.wrap(torch.optim.AdamW(params), "fp32", max_grad_norm=-1.0)
    with pytest.raises(ValueError, match="clip_mode"):
        oc.wrap(torch.optim.AdamW(params), "fp32", clip_mode="sometimes")
    with pytest.raises(ValueError, match="prefetch_during_backward"):
        oc.wrap(torch.optim.AdamW(params), "fp32", release_gradients=True, prefetch_during_backward=True)
    with pytest.raises(ValueError, match="release_gradients"):
        oc.wrap(torch.optim.AdamW(params), "fp32", release_gradients="yes")
    opt = oc.wrap(torch.optim.AdamW(params), "fp32", release_gradients=True)
    with pytest.raises(ValueError, match="max_grad_norm"):
        opt.max_grad_norm = 0
    opt.max_grad_norm = 1.0
    assert opt.max_grad_norm == 1.0 and opt.clip_mode == "auto" and opt.release_gradients


def test_a_framework_hands_its_clipping_over_through_one_method():
    """take_over_clipping: the seam the HF, Lightning and Accelerate adapters use. Without release
    the framework keeps clipping; with it the optimizer takes the norm, and a conflicting norm or
    norm type is refused by name, changing nothing."""
    plain = oc.wrap(torch.optim.AdamW(mlp().parameters()), "fp32")
    assert plain.take_over_clipping(1.0) is False and plain.max_grad_norm is None
    released = oc.wrap(torch.optim.AdamW(mlp().parameters()), "fp32", release_gradients=True)
    assert released.take_over_clipping(1.0, check_only=True) and released.max_grad_norm is None
    assert released.take_over_clipping(1.0) and released.max_grad_norm == 1.0
    with pytest.raises(ValueError, match="gradient_clip_val=2.0"):
        released.take_over_clipping(2.0, source="gradient_clip_val")
    with pytest.raises(ValueError, match="norm_type"):
        released.take_over_clipping(1.0, norm_type=1)
    with pytest.raises(ValueError, match="max_grad_norm"):
        oc.wrap(torch.optim.AdamW(mlp().parameters()), "fp32", release_gradients=True).take_over_clipping(-1.0)
    assert released.max_grad_norm == 1.0 and released.grad_norm_so_far is None
