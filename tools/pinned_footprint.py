"""Pinned host memory of a preset's host-tier state for named Llama shapes, computed (no GPU):
the padded requests, one allocation per request, and the arena's shared slabs (``state/pinned.py``'s
rule, through ``PinnedArena.allocations``), each allocation rounded up to a power of two as torch's
caching host allocator does. A model of the allocator, not a measurement: at 70B on 4 GPUs a
rank's resident host memory was measured at 65 GiB with one allocation per request, where this
counts 37.8 GiB, and at 38.5 GiB with shared slabs. Shared slabs are the default
(``OPTSTATE_PINNED_SLAB_BYTES=0`` turns them off); the slab column is for 256 MiB slabs.

    python tools/pinned_footprint.py --shapes 0.95b,8b,70b [--preset bf16w-4bit-lean-offload] [--gpus 4]

``--gpus N``: per rank under FSDP2 (each parameter's first dimension split into N shards).
Requests are made in backward's order (parameters in reverse), states key by key, as the first
step makes them.
"""
from __future__ import annotations

import argparse
import math
from typing import List, Tuple

import torch


def requests(shape_name: str, preset: str, gpus: int = 1) -> List[Tuple[int, torch.dtype]]:
    """(padded bytes, dtype) of every pinned request of ``preset``'s host-tier state (the states
    ``optstate plan`` counts, per rank)."""
    from optstate_core.apps.llama import NAMED_SHAPES
    from optstate_core.apps.model_shapes import config_shapes
    from optstate_core.apps.plan import param_states
    from optstate_core.state.pinned import padded_bytes
    from optstate_core.state.store import payload_layout_of

    shapes = [(name, (-(-shape[0] // gpus), *shape[1:]))
              for name, shape in config_shapes(NAMED_SHAPES[shape_name].hf_config())]
    out = []
    for (_, shape), entries in reversed(list(zip(shapes, param_states(shapes, preset, "adamw", torch.float32)))):
        for _, codec, tier, _ in entries:
            if tier == "host":
                out += [(padded_bytes(math.prod(s), dtype), dtype)
                        for s, dtype, _ in payload_layout_of(codec, shape, torch.float32).values()]
    return out


def pow2(n: int) -> int:
    """The bytes torch's caching host allocator reserves for a request of ``n``: the next power of two."""
    return 1 << (n - 1).bit_length()


def footprint(reqs, slab_bytes=None) -> Tuple[int, int, int]:
    """(requested, one allocation per request, the arena's slabs up to ``slab_bytes``, by default
    the largest it shares when switched on) in bytes, each allocation rounded as torch's host
    allocator rounds it."""
    from optstate_core.state.pinned import SLAB_BYTES, PinnedArena
    slab_bytes = SLAB_BYTES if slab_bytes is None else slab_bytes
    asked = sum(n for n, _ in reqs)
    own = sum(pow2(n) for n, _ in reqs)
    return asked, own, sum(pow2(n) for n in PinnedArena(slab_bytes, pin=False).allocations(reqs))


def main(argv=None) -> str:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="0.95b,8b,70b")
    p.add_argument("--preset", default="bf16w-4bit-lean-offload")
    p.add_argument("--gpus", type=int, default=1)
    args = p.parse_args(argv)
    if args.gpus < 1:
        p.error(f"--gpus must be >= 1, got {args.gpus}")
    lines = [f"| shape | requests | GiB requested | GiB as own allocations | GiB in shared slabs |  ({args.preset}, "
             f"per rank of {args.gpus})", "|---|---:|---:|---:|---:|"]
    for name in args.shapes.split(","):
        reqs = requests(name, args.preset, args.gpus)
        asked, own, slabs = footprint(reqs)
        lines.append(f"| {name} | {len(reqs)} | {asked / 2**30:.2f} | {own / 2**30:.2f} | {slabs / 2**30:.2f} |")
    text = "\n".join(lines)
    print(text)
    return text


if __name__ == "__main__":
    main()
