"""DDP and FSDP2 with 2 gloo processes against single-process results, and DCP checkpoints
(round trip on 2 ranks, then resharded onto 1 process)."""
import math
import os
import sys

import pytest
import torch
import torch.multiprocessing as mp

import optstate_core as oc

sys.path.insert(0, os.path.dirname(__file__))
import dist_jobs  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")


def assert_close_up_to_code_flips(got, ref):
    """Within fp32 round-off except where it moved an int8 code by one step: those elements stay
    within a tenth of a learning rate (one code step of momentum is <= 1/15 of the update)."""
    diff = (got - ref).abs()
    assert diff.max() <= 0.1 * dist_jobs.LR
    assert (diff <= 1e-5).float().mean() >= 0.99


def spawn(job, tmp_path):
    mp.spawn(job, args=(2, str(tmp_path)), nprocs=2, join=True)


def single_process_reference(steps=3):
    model = dist_jobs.build_model()
    opt = dist_jobs.make_optimizer(model)
    dist_jobs.train(model, opt, steps)
    return model, opt


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp")
    spawn(dist_jobs.fsdp_job, tmp)
    return tmp, torch.load(tmp / "fsdp_result.pt", weights_only=False)


def test_misaligned_1d_shards_stay_uncompressed():
    """A 1-D parameter whose FSDP2 shards are not whole blocks keeps fp32 state (decided from the
    global shape and mesh size, so every rank agrees)."""
    from types import SimpleNamespace

    from optstate_core.state.dtensor import slab_placements
    from torch.distributed.tensor import Shard

    mesh = SimpleNamespace(size=lambda dim=0: 2)
    fake = SimpleNamespace(placements=[Shard(0)], device_mesh=mesh, dim=lambda: 1, shape=(256,))
    assert slab_placements(fake) is None
    fake.shape = (1024,)
    assert slab_placements(fake) == [Shard(1)]


def test_fsdp2_matches_single_process(fsdp):
    _, out = fsdp
    model, opt = single_process_reference()
    for got, ref in zip(out["params"], model.parameters()):
        assert_close_up_to_code_flips(got, ref.detach())
    for got, p in zip(out["exp_avg"], model.parameters()):  # decoded first moments, gathered
        ref = opt.get_state(p)["exp_avg"]
        assert (got - ref).abs().max() <= ref.abs().max() / 15
    # codecs chosen from global shapes, the same on both ranks and in the reference
    assert out["codecs"] == ["int8", "int8", "int8", "fp32", "int8", "fp32"]
    # each rank holds about half of the single-process state
    assert out["local_state_bytes"] < 0.55 * opt.memory_report()["state_bytes"]


def test_nan_in_one_shard_skips_the_parameter_everywhere(fsdp):
    _, out = fsdp
    assert out["nan_param_unchanged"]
    assert out["nonfinite_skipped"] == 1


def test_dcp_round_trip_on_two_ranks(fsdp):
    _, out = fsdp
    assert out["resumed_step_count"] == 4
    for a, b in zip(out["resumed"], out["expected"]):
        assert torch.equal(a, b)


def test_dcp_reshard_onto_one_process(fsdp):
    from torch.distributed.checkpoint import load
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)

    tmp, out = fsdp
    model, opt = single_process_reference(steps=1)  # a one-process optimizer with state to load into
    sd = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    load(sd, checkpoint_id=str(tmp / "dcp"))
    set_model_state_dict(model, sd["model"])
    set_optimizer_state_dict(model, opt, sd["optim"])
    assert opt.step_count == 4
    dist_jobs.train(model, opt, 2, first=4)
    for a, b in zip(model.parameters(), out["expected"]):
        assert_close_up_to_code_flips(a.detach(), b)


def test_ddp_matches_single_process(tmp_path):
    spawn(dist_jobs.ddp_job, tmp_path)
    out = torch.load(tmp_path / "ddp_result.pt", weights_only=False)
    assert out["ranks_equal"]
    model, _ = single_process_reference()
    ref = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    assert_close_up_to_code_flips(out["params"], ref)


def test_fsdp2_fp32_state_of_a_fused_adamw_goes_to_the_kernel(tmp_path):
    """Under FSDP2 the kernels take fp32 state of a ``fused=True`` AdamW shard by shard (torch's
    fused CUDA arithmetic, interpreted here): every parameter on the kernel path, and the run
    matches torch's own fused AdamW of this device under the same sharding within |diff| <= 1e-6
    + 2e-5 |p| (its CPU kernel orders the arithmetic differently: tests/kernels/test_fused_step.py)."""
    spawn(dist_jobs.fsdp_fp32_fused_job, tmp_path)
    out = torch.load(tmp_path / "fsdp_fp32_result.pt", weights_only=False)
    assert out["fused_params"] == len(out["torch"])
    for got, ref in zip(out["optstate"], out["torch"]):
        torch.testing.assert_close(got, ref, rtol=2e-5, atol=1e-6)


def test_fsdp2_with_master_weights_as_state(tmp_path):
    """bf16 parameters sharded by FSDP2, their masters sharded as optimizer state: the run matches
    one process up to bf16 gradient noise, each rank holds about half of the state, and a DCP
    checkpoint resumes exactly.

    bf16 gradients summed in another order differ in their last bits; Adam normalizes, so an
    element whose gradient is near zero may move by up to a learning rate either way (one
    process with the batch in two accumulated halves differs from one pass just as much)."""
    from optstate_core.state.master_weights import MASTER_KEY

    spawn(dist_jobs.fsdp_master_job, tmp_path)
    out = torch.load(tmp_path / "fsdp_master_result.pt", weights_only=False)
    model = dist_jobs.master_model()
    opt = dist_jobs.master_optimizer(model)
    dist_jobs.train_bf16(model, opt, 3)
    def assert_close_up_to_bf16_noise(got, ref):
        diff = (got - ref).abs()
        assert diff.max() <= 3 * dist_jobs.LR  # 3 steps
        assert (diff <= 1e-3).float().mean() >= 0.99

    for got, ref in zip(out["params"], model.parameters()):
        assert_close_up_to_bf16_noise(got, ref.detach().float())
    for got, ref in zip(out["masters"], oc.master_state_dict(model, opt).values()):
        assert_close_up_to_bf16_noise(got, ref)  # the fp32 masters agree like the parameters
    assert all(out["has_correction"])  # every bf16 parameter keeps a (sharded) correction
    assert out["local_state_bytes"] < 0.55 * opt.memory_report()["state_bytes"]
    for got, ref in zip(out["resumed"], out["expected"]):
        assert torch.equal(got, ref)


def test_fsdp2_dcp_resume_with_state_in_host_memory_is_exact(tmp_path):
    """All state in host memory (the offloaded lean preset, gradient release) under FSDP2: a DCP
    checkpoint resumes bit for bit, the 128-element bias shards (uncompressed, host-tier) included.
    Before the fix their state went out as one replicated payload, and a rank resumed from another's."""
    spawn(dist_jobs.fsdp_host_state_job, tmp_path)
    out = torch.load(tmp_path / "fsdp_host_state_result.pt", weights_only=False)
    assert out["bias_state_on_host"]
    for got, ref in zip(out["resumed"], out["expected"]):
        assert torch.equal(got, ref)


def test_a_named_model_is_sharded_on_the_meta_device_before_it_is_materialized(tmp_path):
    """The 70B path's build (tools/fsdp_bench.py --model): each of 2 ranks allocates only its half of
    the parameters, initializes it (matrices N(0, 0.02), norms 1), and trains."""
    pytest.importorskip("transformers")
    from optstate_core.apps.llama import NAMED_SHAPES
    spawn(dist_jobs.sharded_build_job, tmp_path)
    seen = torch.load(tmp_path / "sharded_build.pt")
    assert seen["global"] == NAMED_SHAPES["tiny"].params
    assert seen["local"] <= seen["global"] // 2 + 4096 and seen["on_cpu"] and seen["norms_one"]
    assert 0.015 < seen["matrix_std"] < 0.025
    assert all(math.isfinite(x) for x in seen["losses"]) and seen["losses"][-1] < seen["losses"][0]
