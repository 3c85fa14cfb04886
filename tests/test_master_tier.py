"""The master-weight correction in its own tier: ``master_tier="host"`` (the ``-hostcorr`` presets)
keeps bf16 weights and moments resident and streams only the correction through the staging ring.

Moving bytes changes no value: every run here is bit-identical to the all-resident one, on the
fused kernels (interpreted on the CPU; real streams on a GPU) and the reference path, with
gradient release too. Also the first fused step of any offloaded correction, which must read
the remainder ``cast_model`` kept (it used to read the staging ring's stale bytes).
"""
import io

import pytest
import torch

import optstate_core as oc
from helpers import bf16_param_list
from optstate_core.state.master_weights import MASTER_KEY, cast_model, join

pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# a row-split matrix (the small ring streams it in pieces), a 1-D tensor under 4096 elements (fp32
# moments stay raw device tensors beside a host correction), and a second matrix
SHAPES = [(24, 256), (300,), (8, 512)]


def model(seed=0):
    return bf16_param_list(SHAPES, seed, DEVICE)


def set_grads(ps, step):
    g = torch.Generator().manual_seed(100 + step)
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g).to(DEVICE, torch.bfloat16)


def masters(opt, ps):
    return [join(p.detach(), opt.state[p][MASTER_KEY].decode(p.device)) for p in ps]


def train(preset, steps=3, fused=True, release=False, **options):
    m = model()
    ps = list(m.parameters())
    opt = oc.wrap(torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1), preset, fused=fused,
                  release_gradients=release, staging_bytes="16KB", **options)
    for s in range(steps):
        set_grads(ps, s)
        if release:
            for p in ps:  # what autograd's post-accumulate-grad hooks do on the boundary micro-batch
                opt._engine.schedule.gradient_ready(p)
            opt._engine.clip_release.flush()  # and its callback at the end of backward
            assert all(p.grad is None for p in ps)
        opt.step()
    return ps, opt


@pytest.mark.parametrize("moments", ["4bit", "8bit"])
def test_host_correction_is_bit_identical_to_resident_on_the_fused_path(moments):
    ps0, ref = train(f"bf16w-{moments}-lean")
    ps1, opt = train(f"bf16w-{moments}-lean-hostcorr")
    assert opt.last_step_timings["fused_params"] == len(SHAPES)  # every parameter took the kernel
    for p, q in zip(ps0, ps1):
        assert torch.equal(p, q)
        assert ref.state[p][MASTER_KEY].host_tier is False
        assert opt.state[q][MASTER_KEY].host_tier is True
        assert opt.state[q][MASTER_KEY].payload["data"].device.type == "cpu"
        for key in ("exp_avg", "exp_avg_sq"):  # the moments stay resident
            value = opt.state[q][key]
            assert getattr(value, "host_tier", False) is False and value.device == q.device
    for a, b in zip(masters(ref, ps0), masters(opt, ps1)):
        assert torch.equal(a, b)
    n = sum(p.numel() for p in ps1)
    report, ref_report = opt.memory_report(), ref.memory_report()
    assert report["host_bytes"] == n  # corr8: one byte per element, nothing else on the host
    assert report["device_bytes"] == ref_report["device_bytes"] - n
    assert report["training_bytes"]["master_correction"] == {"device": 0, "host": n}


def test_host_correction_with_gradient_release_and_on_the_reference_path():
    ps0, _ = train("bf16w-4bit-lean")
    ps1, opt = train("bf16w-4bit-lean-hostcorr", release=True)
    assert opt.last_step_timings["fused_params"] == 0  # all were updated in the hooks
    assert all(torch.equal(p, q) for p, q in zip(ps0, ps1))
    ps2, ref = train("bf16w-4bit-lean", fused=False)
    ps3, opt = train("bf16w-4bit-lean-hostcorr", fused=False)
    assert all(torch.equal(p, q) for p, q in zip(ps2, ps3))
    assert all(opt.state[p][MASTER_KEY].host_tier for p in ps3)
    for a, b in zip(masters(ref, ps2), masters(opt, ps3)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("seed_elements", [1 << 24, 700], ids=["whole", "row-blocks"])
@pytest.mark.parametrize("options", [dict(offload=True), dict()], ids=["offload", "hostcorr"])
def test_first_fused_step_reads_the_offloaded_cast_remainder(options, seed_elements, monkeypatch):
    """lr 0: the masters after one step are the exact fp32 values cast_model split (corr16), also
    when the new correction is encoded in blocks of rows (as an 8B model's embedding is)."""
    from optstate_core.step import fused
    monkeypatch.setattr(fused, "SEED_ELEMENTS", seed_elements)
    g = torch.Generator().manual_seed(0)
    exact = [(torch.randn(s, generator=g) * 0.5).to(DEVICE) for s in SHAPES]
    policy = oc.make_policy("bf16w-4bit", master_tier=None if options else "host")
    m = model()
    ps = list(m.parameters())
    opt = oc.wrap(torch.optim.AdamW(ps, lr=0.0, weight_decay=0.0), policy, fused=True, staging_bytes="16KB",
                  **options)
    set_grads(ps, 0)
    opt.step()
    assert opt.last_step_timings["fused_params"] == len(SHAPES)
    assert all(opt.state[p][MASTER_KEY].host_tier for p in ps)
    for x, want in zip(masters(opt, ps), exact):
        assert torch.equal(x, want)


def test_host_correction_checkpoint_loads_into_a_resident_optimizer():
    ps, opt = train("bf16w-4bit-lean-hostcorr", steps=2)
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    twin = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    resident = oc.wrap(torch.optim.AdamW(twin, lr=1e-2, weight_decay=0.1), "bf16w-4bit-lean", fused=True)
    buf.seek(0)
    resident.load_state_dict(torch.load(buf, weights_only=True))
    assert not any(resident.state[p][MASTER_KEY].host_tier for p in twin)
    for o, params in ((opt, ps), (resident, twin)):
        set_grads(params, 7)
        o.step()
    assert all(torch.equal(p, q) for p, q in zip(ps, twin))


def test_master_tier_is_validated_and_planned():
    from optstate_core.apps import plan
    with pytest.raises(ValueError, match="master_tier"):
        oc.make_policy("bf16w-4bit-lean", master_tier="gpu")
    shapes = [("a.weight", (64, 512)), ("b.weight", (300, 700))]
    n = 64 * 512 + 300 * 700
    lean, host = plan.state_bytes(shapes, "bf16w-4bit-lean"), plan.state_bytes(shapes, "bf16w-4bit-lean-hostcorr")
    assert (host.correction_device, host.correction_host) == (0, n) and lean.correction_device == n
    assert host.device == lean.device - n and host.host == n
    assert "master_tier='host'" in oc.make_policy("bf16w-8bit-lean-hostcorr").describe()


def test_peak_bytes_rows_include_the_host_correction_presets():
    from optstate_core.apps import contenders, peakbytes
    from optstate_core.apps.llama import NAMED_SHAPES
    assert "bf16w-4bit-lean-hostcorr" in peakbytes.DEFAULT_OPTIMIZERS.split(",")
    c = contenders.parse("bf16w-4bit-lean-hostcorr")
    assert c.weights == torch.bfloat16 and c.release and not c.offload
    assert contenders.hint_bytes_per_param(c) == 3.0  # bf16 weights 2 + 4-bit moments 1; correction on the host
    shape = NAMED_SHAPES["8b"]
    n = shape.params
    trial = {"status": "ok", "peak_step_bytes": 10 * n, "held_bytes": 3 * n, "optimizer_host_bytes": n,
             "step_s": 1.0, "tokens_per_s": 2048.0}
    base = {"status": "ok", "peak_step_bytes": 9 * n, "weight_bytes": 2 * n}
    row = peakbytes.summarize("8b", shape, "bf16w-4bit-lean-hostcorr", trial, base)
    assert row["bytes_per_param_at_peak"] == 3.0  # 10n - (9n - 2n) activations
    assert peakbytes.table_row(row).endswith("| 3.00 | 3.00 | 1.000 | 2048 | 1.00 |")  # host B/param last


def test_host_correction_uploads_during_backward_with_prefetch():
    """Backward-time prefetch stages only the host-tier correction (the moments stay in place); an
    explicit budget: "auto" (prefetch_during_backward=True) measures what backward frees on a GPU,
    next to nothing for this model."""
    def net():
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(512, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).to(DEVICE)
        cast_model(m)
        return m

    runs = []
    for preset, options in (("bf16w-4bit-lean", {}),
                            ("bf16w-4bit-lean-hostcorr", dict(prefetch_budget="1MB", staging_bytes="1MB"))):
        m = net()
        opt = oc.wrap(torch.optim.AdamW(m.parameters(), lr=1e-2), preset, fused=True, **options)
        for s in range(4):
            x = torch.randn(8, 512, generator=torch.Generator().manual_seed(s)).to(DEVICE, torch.bfloat16)
            m(x).float().square().mean().backward()
            opt.step()
            opt.zero_grad()
        runs.append((m, opt))
    (ref_m, _), (m, opt) = runs
    assert all(torch.equal(p, q) for p, q in zip(ref_m.parameters(), m.parameters()))
    report = opt.memory_report()["prefetch"]
    ps = list(m.parameters())
    assert report["bytes_by_phase"]["backward"] == sum(p.numel() for p in ps)  # corr8: 1 B per element
    assert report["used_bytes_last_step"] == sum(-(-p.numel() // 16) * 16 for p in ps)  # each padded to 16 B
    assert report["bytes_by_phase"]["step"] == 0  # nothing left to upload in step(); the moments never move


@pytest.mark.parametrize("release", [False, True], ids=["step", "release"])
def test_offload_preset_and_a_budget_under_release_are_bit_identical_to_resident(release):
    """``bf16w-4bit-lean-offload`` keeps moments and correction on the host, and a ``gpu_budget``
    keeps part of the state resident (gradient release assigns residency over every parameter
    before its first update): both train exactly as the all-resident preset."""
    ps0, _ = train("bf16w-4bit-lean")
    ps1, off = train("bf16w-4bit-lean-offload", release=release)
    n = sum(p.numel() for p in ps1)
    for p, q in zip(ps0, ps1):
        assert torch.equal(p, q)
        assert all(off.state[q][k].host_tier for k in ("exp_avg", "exp_avg_sq", MASTER_KEY))
    assert off.memory_report()["device_bytes"] == 0 and off.memory_report()["host_bytes"] > n
    budget = 24 * 256 * 2  # the first matrix's 4-bit moments and correction, not the rest
    ps2, part = train("bf16w-4bit-lean", release=release, gpu_budget=budget + 16384)
    assert all(torch.equal(p, q) for p, q in zip(ps0, ps2))
    tiers = [part.state[q][MASTER_KEY].host_tier for q in ps2]
    assert tiers[0] is False and tiers[2] is True, tiers
    assert 0 < part.memory_report()["device_bytes"] <= budget + 16384


def test_release_stages_batches_ahead_and_stays_bit_identical(monkeypatch):
    """Gradient release over offloaded state uploads the next two batches expected (the previous
    step's order) while the current one updates, and the next step's first two at the end of a
    step (``zero_grad`` keeps those copies): from the second step on nothing streams through the
    ring. Steps whose batches come in another order (a staged copy then waits, a batch that already
    updated is not staged again) or lack a parameter stay bit-identical to resident state without
    release."""
    monkeypatch.setenv("OPTSTATE_STAGE_AHEAD", "2")
    orders = [[0, 1, 2], [0, 1, 2], [2, 1, 0], [0, 2], [0, 1, 2]]

    def run(preset, release):
        ps = list(model().parameters())
        opt = oc.wrap(torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1), preset, fused=True,
                      release_gradients=release, release_bucket_bytes=512, staging_bytes="16KB")
        phases = []
        for s, order in enumerate(orders):
            set_grads(ps, s)
            for i in set(range(3)) - set(order):
                ps[i].grad = None
            if release:
                for i in order:  # one batch per parameter (each gradient exceeds 512 bytes)
                    opt._engine.schedule.gradient_ready(ps[i])
                opt._engine.clip_release.flush()
            opt.step()
            opt.zero_grad()
            phases.append(dict(opt.memory_report()["prefetch"]["bytes_by_phase"],
                               ahead=len(opt._engine.schedule.area.entries)))
        return ps, phases

    ref, _ = run("bf16w-4bit-lean", release=False)
    ps, phases = run("bf16w-4bit-lean-offload", release=True)
    assert all(torch.equal(p, q) for p, q in zip(ref, ps))
    assert phases[0]["backward"] == 0 and phases[0]["ahead"] == 2  # first step: the ring; then p0, p1 staged
    assert phases[1]["step"] == 0 and phases[1]["backward"] > 0  # every batch found its state staged
    assert phases[2]["step"] > 0  # p2 came first and streamed; p1 and p0 were staged
    assert phases[3]["step"] > 0  # p0 came first (p2 and p1 were staged): streamed
    assert phases[4]["step"] > 0 and phases[4]["ahead"] == 2  # p1 sat out the last step: streamed


def test_release_over_offloaded_state_with_accumulation_and_autograd_hooks():
    """The real hooks of an autograd backward (a model with biases and a LayerNorm), windows of two
    micro-batches marked with set_step_boundary, several released batches per backward and the
    offloaded preset staging them ahead: bit for bit the resident preset without release, and the
    copies staged at the end of a step wait through the next window's first micro-batch."""
    def net():
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.LayerNorm(64),
                                torch.nn.Linear(64, 8)).to(DEVICE)
        cast_model(m)
        return m

    runs = []
    for preset, release in (("bf16w-4bit-lean", False), ("bf16w-4bit-lean-offload", True)):
        m = net()
        opt = oc.wrap(torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1), preset, fused=True,
                      release_gradients=release, release_bucket_bytes=256, staging_bytes="16KB")
        g = torch.Generator().manual_seed(3)
        staged = []
        for i in range(8):
            opt.set_step_boundary(i % 2 == 1)
            x = torch.randn(8, 32, generator=g).to(DEVICE, torch.bfloat16)
            m(x).float().square().mean().backward()
            if i % 2 == 1:
                opt.step()
                opt.zero_grad()
            staged.append(len(opt._engine.schedule.area.entries))
        runs.append((m, opt, staged))
    (ref, _, _), (m, opt, staged) = runs
    assert all(torch.equal(p, q) for p, q in zip(ref.parameters(), m.parameters()))
    assert opt._engine.clip_release.released == 0 and len(opt._engine.clip_release._last_order) > 2
    assert staged[-2] > 0 and staged[-2] == staged[-1]  # staged after a step, still there after the next micro-batch
    assert opt.memory_report()["prefetch"]["bytes_by_phase"]["step"] == 0  # every batch found its state staged


def test_stage_ahead_setting_is_validated(monkeypatch):
    """``OPTSTATE_STAGE_AHEAD`` (read when the optimizer is built) must be an integer >= 0: anything
    else is refused by name and nothing is built; 0 stages nothing, 1 one batch ahead."""
    ps = list(model().parameters())
    for bad in ("-1", "two", "1.5"):
        monkeypatch.setenv("OPTSTATE_STAGE_AHEAD", bad)
        with pytest.raises(ValueError, match="OPTSTATE_STAGE_AHEAD must be an integer >= 0"):
            oc.wrap(torch.optim.AdamW(ps, lr=1e-2), "bf16w-4bit-lean-offload", fused=True, release_gradients=True)
    for depth in (0, 1):
        monkeypatch.setenv("OPTSTATE_STAGE_AHEAD", str(depth))
        opt = oc.wrap(torch.optim.AdamW(ps, lr=1e-2), "bf16w-4bit-lean-offload", fused=True,
                      release_gradients=True, release_bucket_bytes=512, staging_bytes="16KB")
        for s in range(2):
            set_grads(ps, s)
            for p in ps:
                opt._engine.schedule.gradient_ready(p)
            opt.step()
        assert len(opt._engine.schedule.area.entries) == depth  # one parameter per batch here
        opt.close()


def test_release_stages_past_resident_batches(monkeypatch):
    """Under a ``gpu_budget`` the first batches in backward order stay resident and need no
    upload: staging ahead passes over them, so the first streamed batch uploads at the end of the
    step (behind the next forward) even one batch ahead, and every later step finds all its
    streamed state staged; bit for bit all-resident state."""
    monkeypatch.setenv("OPTSTATE_STAGE_AHEAD", "1")
    budget = 24 * 256 * 2 + 16384  # the first matrix's 4-bit moments and correction, beside the ring

    def run(preset, **options):
        ps = list(model().parameters())
        opt = oc.wrap(torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1), preset, fused=True,
                      release_gradients=bool(options), release_bucket_bytes=512, staging_bytes="16KB", **options)
        staged = []
        for s in range(4):
            set_grads(ps, s)
            if options:
                for p in ps:  # one batch per parameter, the resident one first
                    opt._engine.schedule.gradient_ready(p)
                opt._engine.clip_release.flush()
            opt.step()
            opt.zero_grad()
            staged.append((len(opt._engine.schedule.area.entries),
                           opt.memory_report()["prefetch"]["bytes_by_phase"]["step"]))
        return ps, opt, staged

    ref, _, _ = run("bf16w-4bit-lean")
    ps, opt, staged = run("bf16w-4bit-lean", gpu_budget=budget)
    assert all(torch.equal(p, q) for p, q in zip(ref, ps))
    assert [opt.state[p][MASTER_KEY].host_tier for p in ps] == [False, True, True]
    assert staged[0][0] == 1  # the first step: p0 resident, p1 staged for the next step (not nothing)
    assert all(entries == 1 and streamed == 0 for entries, streamed in staged[1:])  # nothing left for the ring
