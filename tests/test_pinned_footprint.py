"""tools/pinned_footprint.py: the arena's slabs hold a named shape's offloaded state in less pinned
memory than one allocation per state, and never less than was requested."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tools"))
import pinned_footprint  # noqa: E402


def test_slabs_take_less_than_one_allocation_per_state_for_8b():
    reqs = pinned_footprint.requests("8b", "bf16w-4bit-lean-offload")
    asked, own, slabs = pinned_footprint.footprint(reqs)
    assert len(reqs) > 1000 and asked <= slabs < own
    assert slabs < 1.01 * asked  # first fit wastes under 1% here (filling one slab at a time: 13%)
    assert pinned_footprint.footprint(reqs, slab_bytes=0)[2] == own  # no sharing: one allocation each
    assert "| tiny |" in pinned_footprint.main(["--shapes", "tiny", "--gpus", "2"])
