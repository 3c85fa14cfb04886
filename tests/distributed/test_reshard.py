"""Checkpoints that survive a change of mesh (issue 59, item 3): a DCP checkpoint saved on 2 FSDP2
ranks loads on 4 ranks and into one plain process with every state tensor, decoded, equal bit for
bit to the same tensor decoded before saving, and the same codec and tier for every state, for
every preset (reshard_jobs.PRESETS), with and without master weights. One 2-rank spawn trains and
saves all presets, one 4-rank spawn loads them all."""
import os
import sys

import pytest
import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(__file__))
import reshard_jobs  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reshard")
    for sub in ("save", "load4"):
        (tmp / sub).mkdir()
    mp.spawn(reshard_jobs.save_job, args=(2, str(tmp)), nprocs=2, join=True)
    return tmp, torch.load(tmp / "saved.pt", weights_only=False)


@pytest.fixture(scope="module")
def on_four(saved):
    tmp, _ = saved
    mp.spawn(reshard_jobs.load_job, args=(4, str(tmp)), nprocs=4, join=True)
    return torch.load(tmp / "loaded4.pt", weights_only=False)


@pytest.fixture(scope="module")
def on_one(saved):
    return reshard_jobs.load_plain(str(saved[0]))


def bits(t):
    return t.reshape(-1).contiguous().view(torch.uint8)


def assert_same_decoded_state(got, ref):
    for preset in reshard_jobs.PRESETS:
        assert got[preset]["step_count"] == ref[preset]["step_count"] == 2
        assert got[preset]["decoded"].keys() == ref[preset]["decoded"].keys()
        for name, states in ref[preset]["decoded"].items():
            assert got[preset]["decoded"][name].keys() == states.keys(), (preset, name)
            for key, want in states.items():
                have = got[preset]["decoded"][name][key]
                assert have.dtype == want.dtype and have.shape == want.shape, (preset, name, key)
                assert torch.equal(bits(have), bits(want)), (preset, name, key)


def test_loads_on_one_process_bit_for_bit(saved, on_one):
    assert_same_decoded_state(on_one, saved[1])


def test_loads_on_four_ranks_bit_for_bit(saved, on_four):
    assert_same_decoded_state(on_four, saved[1])


def test_codecs_and_tiers_do_not_depend_on_the_mesh(saved, on_one, on_four):
    ref = saved[1]
    for preset in reshard_jobs.PRESETS:
        assert on_one[preset]["forms"] == ref[preset]["forms"] == on_four[preset]["forms"], preset
    # the model covers what it should: compressed and fp32 states, 1-D states split mid-block,
    # master corrections, and host-tier state
    def names(preset, key):
        return {n: ref[preset]["forms"][n][key][0]["name"] for n in ref[preset]["forms"]}

    assert names("8bit", "exp_avg") == {"fc1.weight": "int8", "fc1.bias": "int8", "norm.weight": "int8",
                                        "norm.bias": "int8", "fc2.weight": "int8", "fc2.bias": "fp32",
                                        "head.weight": "fp32", "head.bias": "fp32"}
    assert set(names("4bit", "exp_avg_sq").values()) == {"int4", "fp32"}
    assert set(names("bf16w-4bit", "master_correction").values()) == {"corr16"}
    hostcorr = ref["bf16w-8bit-lean-hostcorr"]["forms"]
    assert all(f["master_correction"] == ({"name": "corr8"}, "host") for f in hostcorr.values())
    assert all(tier == "host" for f in ref["bf16w-4bit-lean-offload"]["forms"].values() for _, tier in f.values())
