"""State in the form the policy wants: allocation of target forms, and re-storing without an update
(after a load, a policy switch, ``offload()``/``reload()``)."""
from __future__ import annotations

from typing import Dict, List

import torch

from ..state.codecs import EncodedTensor
from ..state.dtensor import local
from ..state.store import allocate, allocate_many, as_stored, copy_stored, is_scalar_state, keeps_own_shape, matches
from ..step.work import Work


class Conformer:
    """Decides whether a parameter's stored state has the wanted codec/tier, and makes it so."""

    def __init__(self, engine):
        self.engine = engine

    def needs_tiles(self, w: Work) -> bool:
        """Whether the parameter must go through tiles (its state is encoded or changes form)."""
        engine = self.engine
        if all(map(is_scalar_state, w.state.values())):  # first step: tiles unless the state will be plain device tensors
            return engine.policy.may_compress(w.info, engine.step_count) or engine.tier_of(w, "") == "host"
        return any(isinstance(v, EncodedTensor) for v in w.state.values()) or self.differs(w)

    def differs(self, w: Work) -> bool:
        """Whether any state of the parameter is not in the form (codec and tier) the policy wants
        now; a state already in it is left as it is (re-encoding it would move stochastically
        rounded codes whose decoded value does not land back on its level exactly)."""
        engine = self.engine
        for key, value in w.state.items():
            if is_scalar_state(value) or keeps_own_shape(value, w.key):
                continue
            if not matches(value, engine.codec_of(w, key), engine.tier_of(w, key) == "host", w.param.device):
                return True
        return False

    def preallocate(self, works: List[Work]) -> None:
        """Destinations for states that change form this step, one allocation per form."""
        engine = self.engine
        wanted: Dict[tuple, list] = {}
        for w in works:
            for key, value in w.state.items():
                if is_scalar_state(value) or tuple(local(value).shape) != tuple(w.param.shape):
                    continue
                codec = engine.codec_of(w, key)
                host = engine.tier_of(w, key) == "host"
                if not matches(value, codec, host, w.param.device):
                    wanted.setdefault((codec, host, w.param.device, value.dtype), []).append((w, key))
        for (codec, host, device, dtype), items in wanted.items():
            pin = engine.ctx.pins(device)
            values = allocate_many(codec, [w.param.shape for w, _ in items], dtype, device, host, pin,
                                   engine.pinned)
            for (w, key), value in zip(items, values):
                w.dest[key] = as_stored(w.key, value)

    def destination(self, w: Work, key: str, value: torch.Tensor):
        engine = self.engine
        codec = engine.codec_of(w, key)
        host = engine.tier_of(w, key) == "host"
        current = w.state.get(key)
        if current is not None and matches(current, codec, host, w.param.device):
            return current
        pin = engine.ctx.pins(w.param.device)
        dest = allocate(codec, w.param.shape, value.dtype, w.param.device, host, pin, engine.pinned)
        return as_stored(w.key, dest)

    def conform(self, params=None) -> None:
        """Re-store state in the form the policy wants now (no update), tile by tile; a state
        that only changes tier is copied as it is, one already in its form is not touched."""
        engine = self.engine
        engine.invalidate_plan()
        engine.sync_transfers()
        wanted = None if params is None else {id(p) for p in params}
        works = []
        for p, info in engine.param_infos():
            if p in engine.state and (wanted is None or id(p) in wanted):
                w = Work(p, info, engine.state[p])
                if self.differs(w):
                    works.append(w)
        works = self.retier(works)
        if works:
            engine.tiled.run(works, update=False)

    def retier(self, works: List[Work]) -> List[Work]:
        """Move states whose codec stays the same by copying their payload (nothing is re-encoded,
        so a move there and back gives the same bytes); return the works that still need a
        re-encode. Uncompressed state is a raw tensor on the device and an encoded (identity
        codec) one on the host: :func:`copy_stored` copies between the two forms.

        While parked, host destinations are the park's kept buffers
        (:class:`~optstate_core.schedule.park_buffers.ParkBuffers`). Copies to or from CUDA are
        queued without blocking and waited for once, before the sources are dropped: the device
        memory a park frees is free only after its bytes reached the host."""
        engine = self.engine
        moves: Dict[tuple, list] = {}
        for w in works:
            for key, value, codec, host, shape in same_codec_moves(engine, w):
                moves.setdefault((codec, host, w.param.device, value.dtype), []).append((w, key, value, shape))
        streams = set()
        for (codec, host, device, dtype), items in moves.items():
            pin = engine.ctx.pins(device)
            shapes = [shape for *_, shape in items]
            if host and engine.parked:
                dsts = engine.park_buffers.destinations([(w.info.index, key) for w, key, *_ in items], codec, shapes,
                                                        dtype, device, pin)
            else:
                dsts = allocate_many(codec, shapes, dtype, device, host, pin, engine.pinned)
            for (w, key, src, _), dst in zip(items, dsts):
                copy_stored(dst, src, non_blocking=device.type == "cuda")
                w.state[key] = as_stored(w.key, dst)
            if device.type == "cuda":
                streams.add(torch.cuda.current_stream(device))
        for stream in streams:
            stream.synchronize()
        moves.clear()  # the replaced states (the sources), copied now: their memory may go
        return [w for w in works if self.differs(w)]


def same_codec_moves(engine, w: Work):
    """``(key, value, codec, host, payload shape)`` of each state of a parameter that is not where the
    policy wants it (``host``: the target tier) but keeps its codec, so it moves by a copy."""
    for key, value in w.state.items():
        if is_scalar_state(value) or keeps_own_shape(value, w.key):
            continue
        codec = engine.codec_of(w, key)
        host = engine.tier_of(w, key) == "host"
        encoded = isinstance(value, EncodedTensor)
        same_codec = value.codec == codec if encoded else codec.lossless
        if same_codec and not matches(value, codec, host, w.param.device):
            yield key, value, codec, host, tuple(value.shape if encoded else local(value).shape)
