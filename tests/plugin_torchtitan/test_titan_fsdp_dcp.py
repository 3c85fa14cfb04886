"""(c) Two gloo ranks (torch.multiprocessing.spawn), FSDP2 ``fully_shard`` on a tiny model, the
plugin's container, torchtitan's CheckpointManager (DCP) save and load, with and without gradient
release: the resumed step equals the uninterrupted one bit for bit, each rank saved its shard of
the compressed state (DTensors with the global shape), and the 2-rank checkpoint loads into one
process (resharded) with every state tensor, decoded, equal to the one saved."""
import pytest

pytest.importorskip("torchtitan.components.optimizer")  # a real torchtitan, not a folder of that name

import os  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
import titan_lib as tl  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("titan_fsdp")
    mp.spawn(tl.fsdp_job, args=(2, str(tmp)), nprocs=2, join=True)
    return tmp, torch.load(tmp / "result.pt", weights_only=False)


@pytest.mark.parametrize("release", [False, True])
def test_two_rank_resume_is_bit_identical(two_ranks, release):
    out = two_ranks[1][release]
    assert tl.same(out["resumed"], out["expected"])
    assert tl.same(out["loaded_state"], out["state_at_save"])
    assert out["step_count"] == 2


@pytest.mark.parametrize("release", [False, True])
def test_each_rank_saves_its_shard_of_the_compressed_state(two_ranks, release):
    out = two_ranks[1][release]
    assert out["dtensor_payload"] == "DTensor" and out["global_rows"] == 512 and out["local_rows"] == 256


@pytest.mark.parametrize("release", [False, True])
def test_the_two_rank_checkpoint_loads_into_one_process(two_ranks, release):
    """Resharding: one process, plain parameters, torchtitan's checkpointer on the 2-rank folder."""
    tmp, results = two_ranks
    model = tl.build_model(seed=1)
    optimizers, schedulers = tl.build(model, release=release)
    ckpt = tl.checkpointer(model, optimizers, schedulers, f"{tmp}/release{int(release)}")
    assert ckpt.load(step=2)
    ckpt.close()
    assert tl.same(tl.decoded_state(optimizers), results[release]["state_at_save"])
    assert optimizers.optimizers[0].step_count == 2
